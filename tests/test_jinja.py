"""The Jinja interpreter against Jinja2 itself, set up as Hugging Face sets it up for chat templates:
every standard feature is rendered by both and must give the same text (or both must fail). The
sandbox, the deliberate refusals and the error messages are poot's own and are checked directly."""

import pytest

from poot.errors import TemplateError
from poot.text.jinja import (JinjaRuntimeError, JinjaSecurityError, JinjaSyntaxError, RaisedByTemplate,
                             Template)

jinja2 = pytest.importorskip("jinja2")
pytestmark = pytest.mark.usefixtures("fixed_clock")


def oracle(hf_jinja, source, **context):
    """Jinja2's output, or the exception it raised."""
    try:
        return hf_jinja.from_string(source).render(**context)
    except Exception as e:  # noqa: BLE001 (any failure of the oracle is a result to compare)
        return e


def same(hf_jinja, source, **context):
    """Render with both; the texts must be equal, or both must fail."""
    expected = oracle(hf_jinja, source, **context)
    if isinstance(expected, Exception):
        with pytest.raises(TemplateError):
            Template(source).render(**context)
        return expected
    assert Template(source).render(**context) == expected
    return expected


DATA = dict(d={"a": 1, "items": 5, "b": [1, 2]}, l=[1, 2, 3], s="Hello World", n=None,
            msgs=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])

WHITESPACE = [
    "{% if true %}\nx\n{% endif %}\ny",
    "a\n    {% if true %}\n    b\n    {% endif %}\nc",
    "a   {{- 'b' -}}   c  {%- if true -%}  d  {%- endif %}",
    "{{ 'a' }}\n{{ 'b' }}\n",
    "   {% if true %}x{% endif %}",
    "x   {% if true %}y{% endif %}",
    "x\n\t {% if true %}y{% endif %} z",
    "{% if true %}  \nx{% endif %}",
    "{%+ if true %}x{% endif %}\n  {%+ if true %}y{% endif %}",
    "{% if true +%}\nx{% endif +%}\ny",
    "{# comment #}\nx\n  {# c2 #}\ny",
    "a {#- c -#} b",
    "a\n  {#- c #}\n b",
    "a\n{#- multi\nline comment -#}\nb",
    "{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}\n",
    "{%- for i in [1,2] -%}\n  {{ i }}\n{%- endfor -%}\nend",
    "{{- 'x' -}}\n\n{{- 'y' }}",
    "{% raw %}\n  {{ x }}\n{% endraw %}\nafter",
    "  {% raw %}a{% endraw %}  b",
    "{%- raw -%}  a  {%- endraw -%}  b",
    "x\r\ny\r\n{% if true %}\r\nz{% endif %}\r\n",
    "text\n\n",
    "{{ 'a' }}  \n  {% if true %}b{% endif %}",
    "{% macro m() %}\n  inner\n{% endmacro %}\n[{{ m() }}]",
    "{%- if true %}\n\n  x\n{%- endif %}",
    "line1\n    {{ 'v' }}\n    {% if false %}no{% else %}\n    yes\n    {% endif %}",
    " \t {% for x in [1] %}{{ x }}{% endfor %}",
    "{%if true%}a{%endif%}{%-if true-%} b {%-endif-%}",
    "{{1}}{{-2-}}{{ 3 }}",
    "{% if true %}\n{% if true %}\n  deep\n{% endif %}\n{% endif %}",
    "  {%- if true %}a{% endif %}",
    "{% if true -%}\n\n   x{%- endif %}",
    " {# c #} x",
    "{{ 1 }}\n {# c #}\nb",
]


@pytest.mark.parametrize("source", WHITESPACE)
def test_whitespace_control_and_trim_lstrip_blocks(hf_jinja, source):
    same(hf_jinja, source)


STATEMENTS = [
    "{% for i in [1,2,3] %}{% if i == 1 %}{% set x = 'a' %}{% endif %}{{ x }}{% endfor %}|{{x}}",
    "{% set x = 1 %}{% for i in [1,2] %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}",
    "{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{x}}",
    "{% set a, b = 1, 2 %}{{a}}{{b}}{% set t = 1, 2 %}{{ t }}",
    "{% set x = [1, 2] %}{% set y = x %}{{ y }}",
    "{% set x | upper %}abc{% endset %}{{ x }}",
    "{% set x %}{% set y = 1 %}b{% endset %}{{ y }}{{ x }}",
    "{% filter upper %}{% set y = 1 %}a{% endfilter %}{{ y }}",
    "{% with a = 1 %}{{ a }}{% set b = 2 %}{% endwith %}{{ a }}{{ b }}",
    "{% for n in [1, 2, 3] %}{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %},{% endfor %}",
    "{% if l %}T{% endif %}{% if [] %}F{% else %}E{% endif %}{% if '' %}F{% elif 0 %}F{% elif 'x' %}X{% endif %}",
    "{% for x in [] %}{% else %}E{% endfor %}{% for x in [1] if x > 1 %}{% else %}F{% endfor %}",
    "{% for i in l %}{% endfor %}{{ i }}",
    "{% for a, b in [(1,2),(3,4)] %}{{a}}{{b}}{% endfor %}{% for (a, b) in [[5, 6]] %}{{ a + b }}{% endfor %}",
    "{% for k, v in d.items() %}{{k}}={{v}};{% endfor %}{% for k, v in d|items %}{{k}}{% endfor %}",
    "{% for k, v in d.items() if k != 'a' %}{{ k }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
    "{% for c in 'ab' %}{{ c }}{% endfor %}{% for i in range(3) %}{{ i }}{% endfor %}",
    "{% for i in l %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for i in l %}{% for j in l %}{% if j == 2 %}{% break %}{% endif %}{{ i }}{{ j }}{% endfor %}{% endfor %}",
    "{% for i in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
    "{% for i in l %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.revindex }}-{{ loop.revindex0 }}-{{ loop.depth }};{% endfor %}",
    "{% for i in l %}{% for j in l %}{{ loop.index }}{% endfor %}{{ loop.index }}|{% endfor %}{{ loop }}",
    "{% for i in l if i > 1 %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }};{% endfor %}",
    "{% for i in l %}{{ loop.cycle('a', 'b') }}{% endfor %}{% for i in [1, 1, 2] %}{{ loop.changed(i) }}{% endfor %}",
    "{% for m in msgs[::-1] %}{{ (msgs|length - 1) - loop.index0 }}{{ m.role }}{% endfor %}",
    "{% set ns = namespace(a=1) %}{% for i in l %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}{{ ns.b }}{{ ns }}",
    "{% set ns = namespace() %}{% set ns.x = 'y' %}{{ ns.x }}{{ ns['x'] }}",
    "{% set ns = namespace() %}{% set ns.x %}block{% endset %}{{ ns.x }}",
    "{% set d.x = 1 %}",
    "{% macro m(a, b='x') %}{{a}}{{b}}{{y}}{% endmacro %}{% set y = 1 %}{{ m(1) }}{% set y = 2 %}{{ m(3, 4) }}",
    "{% macro f(a, b=2) %}[{{ a }}{{ b }}{{ varargs }}{{ kwargs }}]{% endmacro %}{{ f(1) }}{{ f(b=5, a=0) }}{{ f(1,2,3) }}{{ f(1, c=4) }}",
    "{% macro f(a, b=a ~ '!') %}{{ b }}{% endmacro %}{{ f('x') }}",
    "{% macro f(a) %}<{{ caller(a) }}>{% endmacro %}{% call(x) f(5) %}got {{ x }}{% endcall %}",
    "{% macro f() %}<{{ caller() }}>{% endmacro %}{% call f() %}body{% endcall %}",
    "{% raw %}{{ not parsed }}{% if %}{% endraw %}",
    "{% generation %}{% set g = 1 %}kept{% endgeneration %}{{ g }}",
]


@pytest.mark.parametrize("source", STATEMENTS)
def test_statements(hf_jinja, source):
    if "generation" in source:  # Hugging Face's own tag: the body renders in its own scope
        assert Template(source).render() == "kept"
        return
    same(hf_jinja, source, **DATA)


EXPRESSIONS = [
    "{{ none }}{{ true }}{{ True }}{{ False }}{{ None }}|{{ 1.5e3 }}|{{ 1_000 }}|{{ 0.1 + 0.2 }}|{{ 0x1F }}|{{ 1e-3 }}",
    "{{ 'a' 'b' }}{{ \"double \\\"quoted\\\" 'single'\" }}{{ 'it\\'s' }}{{ 'a\\\\b' }}{{ '\\u263A' }}{{ '\\x41' }}{{ 'tab\\there' }}",
    "{{ [1,'a',none,true,1.0] }}{{ {'a':[1]} }}{{ (1,) }}{{ (1, 2) }}{{ () }}{{ [] }}{{ {} }}{{ [1, 2,] }}",
    "{{ '{{' }}{{ '}}' }}{{ {'a': {'b': 1}} }}{{ {'a': {'b': 1}}['a']['b'] }}",
    "{{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 10 % 3 }} {{ 1 ~ 2 }}",
    "{{ 1 + 2 * 3 - 4 / 2 }}{{ -l[0] }}{{ +1 }}{{ 2 ** -1 }}{{ 'a' + 'b' ~ 1 + 2 }}{{ -1|abs }}",
    "{{ 'a' * 3 }}{{ [1] * 2 }}{{ '%s-%d' % ('a', 3) }}{{ l + [4] }}",
    "{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 1 == 1.0 }}{{ 'a' != 'b' }}{{ [1] == [1] }}{{ d == d }}{{ none == none }}",
    "{{ not 1 }}{{ not 0 and 1 }}{{ 0 or 'x' }}{{ 1 and 'y' }}{{ n or 'z' }}",
    "{{ 'b' in 'abc' }}{{ 2 in l }}{{ 'a' in d }}{{ 'q' not in d }}{{ 'x' not in s }}{{ not 'x' in s }}",
    "{{ 'a' if l else 'b' }}{{ 'x' if n }}{{ 1 if 0 else 2 if 0 else 3 }}{{ (1 if false) is defined }}",
    "{{ l[::-1] }}{{ l[1:] }}{{ 'abc'[-1] }}{{ l[-2:] }}{{ s[:5] }}{{ s[1::2] }}{{ l[1:2] }}{{ l[:-1] }}{{ s[::-1] }}",
    "{{ l[0] }}{{ l[10] }}{{ d['zz'] }}{{ d.zz }}|{{ msgs[0].role }}{{ msgs[-1]['content'] }}{{ l.1 }}{{ l['1'] }}",
    "{{ d['items'] }}|{{ d.a }}|{{ d.b[1] }}|{{ d['b'].0 }}",
    "{{ s.strip() }}{{ '  x '.lstrip() }}|{{ ' x  '.rstrip() }}|{{ s.split() }}{{ s.split('o') }}{{ s.rsplit(' ', 1) }}",
    "{{ s.startswith('He') }}{{ s.endswith('x') }}{{ s.upper() }}{{ s.lower() }}{{ s.replace('l', 'L') }}{{ s.title() }}",
    "{{ 'ab cd'.capitalize() }}{{ s.find('o') }}{{ s.count('l') }}{{ 'a\\nb'.splitlines() }}{{ '\\n\\nx\\n'.strip('\\n') }}",
    "{{ 'r</think>a'.split('</think>')[-1] }}{{ 'a<b>c'.split('<b>')[0].rstrip('\\n').split('a')[-1].lstrip('\\n') }}",
    "{{ d.get('a') }}{{ d.keys() | list }}{{ d.values()|list }}{{ d.get('zz', 'dflt') }}{{ d.items()|list }}",
    "{{ l.index(2) }}{{ l.count(1) }}{{ (1,2).index(2) }}{{ ', '.join(['a', 'b']) }}",
    "{{ dict(a=1, b=2) }}{{ dict(a=1)['a'] }}{{ namespace(x=1).x }}{{ range(5) }}{{ range(2, 8, 2)|list }}",
    "{{ range(3, -1, -1)|list }}{{ range(0, 3, -1)|list }}",
    "{{ x is undefined }}{{ x is defined }}{{ n is none }}{{ n is not none }}{{ 1 is not string }}{{ x is sameas none }}{{ n is sameas none }}",
    "{{ 1 is number }}{{ true is number }}{{ true is integer }}{{ 1.0 is integer }}{{ 1.5 is float }}{{ true is boolean }}",
    "{{ 'a' is sequence }}{{ {} is sequence }}{{ 1 is iterable }}{{ d is mapping }}{{ l is mapping }}{{ msgs is iterable }}",
    "{{ 2 is even }}{{ 3 is odd }}{{ 3 is divisibleby 3 }}{{ 2 is in [1,2] }}{{ 1 is eq 1 }}{{ 1 is equalto 1 }}",
    "{{ 1 is gt 0 }}{{ 1 is ne 2 }}{{ 1 is lt 2 }}{{ 1 is le 1 }}{{ 2 is ge 1 }}{{ 'A' is upper }}{{ 'a' is lower }}",
    "{{ true is true }}{{ false is false }}{{ 0 is false }}{{ 'x' is string }}{{ x is string }}",
    "{{ x }}|{{ x|default('d') }}{{ ''|default('e', true) }}{{ none|default('f') }}{{ x|d('g') }}{{ x|length }}{{ x|list }}",
    "{{ 'x' in x }}{{ x is iterable }}{{ x is sequence }}{{ x == y }}{{ x ~ 'c' }}{{ x|string }}{{ x|upper }}{{ x|join }}",
]


@pytest.mark.parametrize("source", EXPRESSIONS)
def test_expressions(hf_jinja, source):
    same(hf_jinja, source, **DATA)


FILTERS = [
    "{{ '  x  ' | trim }}|{{ s|trim('Hd') }}|{{ l | length }}|{{ s|count }}|{{ 'Ab' | upper }}{{ 'Ab' | lower }}",
    "{{ 'hello world\\'s-x(y) [z] {w} <v>'|title }}{{ 'ab cd'|capitalize }}{{ 'hELLO'|capitalize }}",
    "{{ s|replace('l', 'L') }}{{ s|replace('l', 'L', 1) }}{{ s|lower|upper|replace('WORLD', 'you') }}",
    "{{ l|join('-') }}{{ [1,2]|join }}{{ msgs|join(', ', attribute='role') }}{{ 'a,b'.split(',')|join('|') }}",
    "{{ l|first }}{{ l|last }}{{ []|first }}{{ 'abc'|last }}{{ d|first }}",
    "{{ 5 | string }}{{ 3|string + 'x' }}{{ [1]|string }}{{ l|list }}{{ 'ab'|list }}{{ d|list }}",
    "{{ '42'|int }}{{ '42.7'|int }}{{ 'x'|int }}{{ 'x'|int(7) }}{{ none|int }}{{ '0x1A'|int(0, 16) }}{{ true|int }}{{ 3.9|int }}",
    "{{ 'x'|float }}{{ '3'|float }}{{ 2|float }}{{ 'x'|float(1.5) }}",
    "{{ 2.5|round }}{{ 3|round }}{{ 2.567|round(2, 'floor') }}{{ 2.561|round(2, 'ceil') }}{{ 3.14159|round(2) }}",
    "{{ -3|abs }}{{ -2.5|abs }}{{ [1,2]|sum }}{{ [1,2]|max }}{{ [3,1]|min }}{{ ['b', 'A']|max }}{{ msgs|sum(attribute='n', start=0) if false }}",
    "{{ [3,1,2]|sort }}{{ ['b','A','a']|sort }}{{ [3,1,2]|sort(reverse=true) }}{{ ['b','A','a']|sort(case_sensitive=true) }}",
    "{{ msgs|sort(attribute='role')|map(attribute='content')|list }}{{ ['b','A','a']|unique|list }}{{ msgs|map(attribute='role')|unique|list }}",
    "{{ {'b':1,'A':2}|dictsort }}{{ d|dictsort(reverse=true) }}{{ {'a': 2, 'b': 1}|dictsort(by='value') }}",
    "{{ l|reverse|list }}{{ 'abc'|reverse }}{{ d|items|list }}",
    "{{ ['a','b']|map('upper')|list }}{{ [{'a':1},{'b':2}]|map(attribute='a')|list }}{{ [{'a':1},{'b':2}]|map(attribute='a', default=0)|list }}",
    "{{ l|map('string')|join }}{{ l|map('int')|sum }}{{ msgs|map(attribute='role')|join(',') }}{{ [{'a': [5]}]|map(attribute='a.0')|list }}",
    "{{ msgs|selectattr('role', 'equalto', 'user')|list }}{{ msgs|rejectattr('role', 'equalto', 'user')|map(attribute='content')|first }}",
    "{{ [0,1,2,none]|select|list }}{{ [1,2,3,4]|select('odd')|list }}{{ [1,2,3,4]|reject('even')|list }}{{ [1,5]|select('gt', 2)|list }}",
    "{{ msgs|selectattr('tool_calls', 'undefined')|list|length }}{{ msgs|selectattr('zz')|list }}{{ msgs|rejectattr('content')|list }}",
    "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}|{{ 'x\\ny'|indent('> ') }}",
    "{{ [1,2,3,4,5]|batch(2)|list }}{{ [1,2,3]|batch(2, 'x')|list }}{{ 'ab'|center(6) }}|{{ 'x'|center(4) }}|{{ 'a b  c'|wordcount }}",
    "{{ '<a>'|e }}{{ '<a>'|safe + '<b>' }}{{ '<b>' + '<a>'|safe }}{{ ('<a>'|e) ~ '<' }}{{ '\"&\\''|escape }}{{ '<x>'|forceescape }}",
    "{{ '%s=%s'|format('a', 1) }}{{ '%(k)s'|format(k='v') }}{{ 'a' ~ none }}",
    "{{ d|attr('a') }}{{ d|attr('get') is defined }}",
    "{{ {'a': [1, 'x', none, true]} | tojson }}{{ 'é ü 中 \\n \\\" </script>'|tojson }}",
    "{{ {'b': [1, {'c': 'x'}], 'a': {}, 'e': []} | tojson(indent=4) }}{{ d|tojson(indent=2) }}",
    "{{ d|tojson(separators=(',', ':')) }}{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}{{ (1, 2)|tojson }}",
    "{{ 'x' is filter }}{{ 'trim' is filter }}{{ 'odd' is test }}",
]


@pytest.mark.parametrize("source", FILTERS)
def test_filters(hf_jinja, source):
    same(hf_jinja, source, **DATA)


FAILURES = [
    "{{ undefinedvar.foo }}",
    "{{ undefinedvar + 1 }}",
    "{{ 1 + undefinedvar }}",
    "{{ undefinedvar[0] }}",
    "{{ undefinedvar() }}",
    "{{ undefinedvar|int }}",
    "{{ undefinedvar < 1 }}",
    "{{ msgs[5].role }}",
    "{{ d.zz.yy }}",
    "{{ 'a' + 1 }}",
    "{{ 5 // 0 }}",
    "{{ n[1:] }}",
    "{% for i in 5 %}{% endfor %}",
    "{% for a, b in [1] %}{% endfor %}",
    "{{ range(100001)|length }}",
    "{{ x|tojson }}",
    "{{ [1]|last|upper(1) }}",
    "{{ raise_exception('boom') }}",
    "{{ l.append(1) }}",
    "{{ l.pop() }}",
    "{{ d.update({}) }}",
    "{{ d.clear() }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ s.__class__() }}",
    "{{ loop.index }}",
]


@pytest.mark.parametrize("source", FAILURES)
def test_failures_match(hf_jinja, source):
    assert isinstance(same(hf_jinja, source, **DATA), Exception)


def test_undefined_behaves_as_jinjas_default():
    assert Template("[{{ missing }}]{{ missing is defined }}{{ not missing }}").render() == "[]FalseTrue"
    assert Template("{% for x in missing %}x{% else %}empty{% endfor %}").render() == "empty"
    assert Template("{{ m.role }}|{{ m.nope is defined }}").render(m={"role": "user"}) == "user|False"
    with pytest.raises(JinjaRuntimeError, match="'missing' is undefined"):
        Template("{{ missing.attr }}").render()
    with pytest.raises(JinjaRuntimeError, match="'dict object' has no attribute 'nope'"):
        Template("{{ m.nope + 'x' }}").render(m={})
    with pytest.raises(JinjaRuntimeError, match="list object has no element 3"):
        Template("{{ l[3].x }}").render(l=[1])


def test_sandbox_refuses_private_attributes_and_mutation(hf_jinja):
    # As Jinja's sandbox: the refused attribute prints as nothing, using it raises.
    same(hf_jinja, "{{ ''.__class__ }}|{{ l.append }}|{{ d.pop }}", **DATA)
    for source in ["{{ ''.__class__.__mro__ }}", "{{ l.append(1) }}", "{{ d.update(a=2) }}",
                   "{{ d.setdefault('z', 1) }}", "{{ msgs.sort() }}", "{{ s['__class__']() }}",
                   "{{ l.__len__() }}", "{{ d.__getitem__('a') }}"]:
        with pytest.raises(JinjaSecurityError, match="unsafe"):
            Template(source).render(**DATA)
    assert DATA["l"] == [1, 2, 3] and DATA["d"] == {"a": 1, "items": 5, "b": [1, 2]}


def test_sandbox_calls_nothing_it_was_not_built_to_call():
    for value in [print, open, len, lambda: "called", object(), type]:
        with pytest.raises(JinjaSecurityError, match="not callable"):
            Template("{{ f() }}").render(f=value)
    # Attributes of other objects are refused like private ones: empty when printed, fatal when used.
    assert Template("{{ f.__name__ }}{{ f.x }}").render(f=lambda: 0) == ""
    with pytest.raises(JinjaSecurityError, match="not reachable"):
        Template("{{ f.__globals__['os'] }}").render(f=lambda: 0)
    # str.format is safe only through Jinja's own sandboxed formatter; poot refuses it.
    with pytest.raises(JinjaSecurityError, match="not supported"):
        Template("{{ '{0.__class__}'.format(s) }}").render(s="x")


def test_sandbox_bounds_sizes():
    for source in ["{{ range(10**6)|length }}", "{{ 'a' * 10**9 }}", "{{ [1] * 10**9 }}", "{{ 7 ** 1000000000 }}",
                   "{{ 'a'.ljust(10**9) }}", "{{ 'a'|center(10**9) }}"]:
        with pytest.raises(JinjaSecurityError):
            Template(source).render()


def test_raise_exception_carries_the_templates_message():
    with pytest.raises(RaisedByTemplate) as info:
        Template("line one\n{% if true %}{{ raise_exception('Roles must alternate!') }}{% endif %}").render()
    assert str(info.value) == "Roles must alternate!"
    assert isinstance(info.value, TemplateError)


def test_strftime_now_reads_the_clock(hf_jinja):
    assert Template("{{ strftime_now('%d %b %Y') }}").render() == "26 Jul 2024"
    same(hf_jinja, "{{ strftime_now('%Y-%m-%d %H:%M') }}")


def test_syntax_errors_name_line_and_column(hf_jinja):
    cases = {
        "ok\n{% if x %}\n{{ 1 + }}": (3, 8),
        "{% for x in y %}\n{{ x }}": (2, 8),
        "{{ x | nosuchfilter }}": (1, 8),
        "{{ x is nosuchtest }}": (1, 9),
        "a\n  {% frobnicate %}": (2, 6),
        "{% endif %}": (1, 4),
        "{{ x ]}}": (1, 6),
        "{# open comment": (1, 1),
        "{{ 'unterminated }}": (1, 4),
        "{% set true = 1 %}": (1, 8),
        "{% break %}": (1, 4),
        "{% macro m(a=1, b) %}{% endmacro %}": (1, 18),
    }
    for source, (line, column) in cases.items():
        with pytest.raises(JinjaSyntaxError) as info:
            Template(source)
        assert (info.value.lineno, info.value.column) == (line, column), source
        assert f"line {line}, column {column}" in str(info.value)
        assert isinstance(oracle(hf_jinja, source), Exception)


def test_unsupported_constructs_say_so():
    for source, what in [("{% include 'other.jinja' %}", "including"), ("{% extends 'base' %}", "inheritance"),
                         ("{% import 'm' as m %}", "importing"), ("{% block b %}{% endblock %}", "inheritance"),
                         ("{% for x in t recursive %}{% endfor %}", "recursive"),
                         ("{% do l.append(1) %}", "'do'")]:
        with pytest.raises(JinjaSyntaxError, match=what):
            Template(source)


def test_runtime_errors_name_the_template_line():
    with pytest.raises(JinjaRuntimeError) as info:
        Template("a\nb\n{{ 1 // 0 }}").render()
    assert info.value.lineno == 3 and "ZeroDivisionError" in str(info.value)


def test_compiled_once_rendered_many_times_with_fresh_state():
    t = Template("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}")
    assert [t.render(xs=list(range(k))) for k in range(5)] == ["0", "0", "1", "3", "6"]


def test_without_trim_and_lstrip_blocks_matches_plain_jinja():
    plain = jinja2.Environment()
    for source in WHITESPACE:
        assert Template(source, trim_blocks=False, lstrip_blocks=False).render() == \
            plain.from_string(source).render(), source
