"""The server's /metrics: counters and histograms kept by the server, gauges read from the engine,
written in the Prometheus text exposition format (version 0.0.4).

The engine keeps its own counts (tokens, queue, KV blocks) and hands a snapshot over; this module
only adds what the HTTP side sees (requests by route and status, latencies) and writes text.
"""
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value):
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value):
    if isinstance(value, float):
        if value == float("inf"):
            return "+Inf"
        return repr(value)
    return str(value)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name):
        out = [f'{name}_bucket{{le="{_number(float(b))}"}} {c}'
               for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_number(float(self.sum))}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """What the HTTP side counts; `render(stats)` adds the engine's snapshot."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = {}          # (route, status) -> count
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.inter_token = Histogram(LATENCY_BUCKETS)

    def count_request(self, route, status):
        with self._lock:
            key = (route, int(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def observe_token(self, first, seconds):
        with self._lock:
            (self.ttft if first else self.inter_token).observe(seconds)

    def render(self, stats):
        """The exposition text; `stats` is the engine's EngineStats, or None while loading."""
        lines = []

        def family(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        with self._lock:
            family("poot_requests_total", "counter", "HTTP requests by route and status.",
                   [f'poot_requests_total{{route="{_escape(r)}",status="{s}"}} {n}'
                    for (r, s), n in sorted(self.requests.items())])
            family("poot_time_to_first_token_seconds", "histogram",
                   "Seconds from a request's arrival to its first generated token.",
                   self.ttft.lines("poot_time_to_first_token_seconds"))
            family("poot_inter_token_latency_seconds", "histogram",
                   "Seconds between consecutive generated tokens of a request.",
                   self.inter_token.lines("poot_inter_token_latency_seconds"))
        if stats is not None:
            for name, kind, help_, value in (
                    ("poot_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                     stats.prompt_tokens_total),
                    ("poot_generation_tokens_total", "counter", "Generated tokens.",
                     stats.generation_tokens_total),
                    ("poot_preemptions_total", "counter",
                     "Sequences preempted for KV blocks (resumed by recomputation).",
                     stats.preemptions_total),
                    ("poot_engine_steps_total", "counter", "Engine steps run.",
                     stats.steps_total),
                    ("poot_engine_steps_ahead_total", "counter",
                     "Engine steps launched on the device's tokens of the step before them, "
                     "before it landed (no launch gap).",
                     stats.steps_ahead_total),
                    ("poot_engine_step_failures_total", "counter",
                     "Engine steps that raised (their requests failed, the rest served on).",
                     stats.step_failures_total),
                    ("poot_queue_length", "gauge", "Requests waiting to be scheduled.",
                     stats.waiting),
                    ("poot_running_sequences", "gauge", "Sequences being generated.",
                     stats.running),
                    ("poot_kv_blocks_used", "gauge", "KV cache blocks held by sequences.",
                     stats.kv_blocks_used),
                    ("poot_kv_blocks_free", "gauge",
                     "KV cache blocks free (cached prefixes included: they are taken back).",
                     stats.kv_blocks_free),
                    ("poot_kv_blocks_cached", "gauge",
                     "KV cache blocks no sequence holds that keep a prompt prefix.",
                     stats.kv_blocks_cached),
                    ("poot_prefix_cache_hit_tokens_total", "counter",
                     "Prompt tokens whose keys and values came from the prefix cache.",
                     stats.prefix_cache_hit_tokens_total),
                    ("poot_prefix_cache_query_tokens_total", "counter",
                     "Prompt tokens looked up in the prefix cache.",
                     stats.prefix_cache_query_tokens_total),
                    ("poot_prefix_cache_evictions_total", "counter",
                     "Cached prefix blocks taken back for new tokens.",
                     stats.prefix_cache_evictions_total),
                    ("poot_engine_launch_gaps_total", "counter",
                     "Steps launched by the engine right after one of theirs landed.",
                     stats.launch_gaps_total),
                    ("poot_engine_launch_gap_seconds_total", "counter",
                     "Host seconds from those landings to the launches (the device waits "
                     "meanwhile, but for a pipeline's other lanes).",
                     _number(float(stats.launch_gap_seconds_total))),
                    ("poot_engine_launch_gap_cpu_seconds_total", "counter",
                     "Of those seconds, the engine thread's own CPU time (the rest it waited "
                     "for the interpreter's lock or a core).",
                     _number(float(stats.launch_gap_cpu_seconds_total)))):
                family(name, kind, help_, [f"{name} {value}"])
            if stats.kernel_times is not None:
                times = sorted(stats.kernel_times.items())
                family("poot_kernel_launches_total", "counter",
                       "Kernel launches timed on the device (--device-timing).",
                       [f'poot_kernel_launches_total{{kernel="{_escape(k)}"}} {n}'
                        for k, (n, _) in times])
                family("poot_kernel_seconds_total", "counter",
                       "Device seconds spent in each kernel (--device-timing).",
                       [f'poot_kernel_seconds_total{{kernel="{_escape(k)}"}} {_number(t)}'
                        for k, (_, t) in times])
        return "\n".join(lines) + "\n"
