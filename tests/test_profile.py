import threading
import time

from poot.serve.profile import StackSampler, thread_kind


def spin_for(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_report_names_where_each_kind_of_thread_spent_its_time(tmp_path):
    path = tmp_path / "profile.txt"
    sampler = StackSampler(path, interval=0.002).start()
    workers = [threading.Thread(target=spin_for, args=(1.0,), name=f"worker-{i}")
               for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sampler.stop()
    report = path.read_text()
    section = report.split("## worker-N: ")[1].split("\n## ")[0]
    samples = int(section.split(" samples")[0])
    assert samples > 20, report         # far fewer than 1 s / 2 ms where CI's cores are busy
    own = section.split("in the function itself:\n")[1].splitlines()[0]
    assert "spin_for (test_profile.py:" in own and float(own.split("%")[0]) > 50, report
    assert "Thread-N (process_request_thread)" == thread_kind("Thread-12 (process_request_thread)")
