"""ShadowKV.request_tags: every path (one decoded token, a few tokens, a long run, a rebuilt cache)
gives the same tags as the definition ``h_p = sum_i (t_i + 1) * B**(p - i) mod 2**64``, plus one."""

import numpy as np
import pytest

from kvaudit.audit.shadow import _B, ShadowKV


def reference(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = (h * _B + t + 1) % (1 << 64)
        v = (h + 1) % (1 << 64)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


class Owner:
    pass


@pytest.mark.parametrize("prompt_len", [0, 1, 5, 16, 17, 40, 300])
def test_tags_match_the_definition_as_a_request_grows(prompt_len):
    shadow, req = ShadowKV({}), Owner()
    origin = [(7 * i + 3) % 97 for i in range(prompt_len)]
    output: list[int] = []
    assert shadow.request_tags(req, origin, output).tolist() == reference(origin)
    for step in range(40):  # decode steps, sometimes with a future token, sometimes a burst of 20
        output.extend([step % 11] * (20 if step == 30 else 1))
        future = [5] if step % 3 == 0 else []
        got = shadow.request_tags(req, origin, output, future)
        assert got.tolist() == reference(origin + output + future)


def test_a_changed_token_rebuilds_the_cache():
    shadow, req = ShadowKV({}), Owner()
    origin, output = [1, 2, 3], [4, 5]
    shadow.request_tags(req, origin, output)
    output[-1] = 9  # the last cached token changed: not an extension
    assert shadow.request_tags(req, origin, output + [6]).tolist() == reference([1, 2, 3, 4, 9, 6])
    assert shadow.request_tags(req, origin, [4]).tolist() == reference([1, 2, 3, 4])  # shorter


def test_prefixes_and_owners_are_distinguished():
    shadow = ShadowKV({})
    a = shadow.request_tags(Owner(), [1, 2, 3]).copy()
    b = shadow.request_tags(Owner(), [1, 2, 4]).copy()
    assert a[:2].tolist() == b[:2].tolist() and a[2] != b[2]
    assert (a != 0).all()  # 0 is reserved for "never written"


def test_read_reports_the_mismatching_positions():
    shadow = ShadowKV({"pool": 8})
    want = shadow.request_tags(Owner(), [1, 2, 3, 4])
    slots = np.array([5, 6, 7, 1])
    shadow.write("pool", slots[:3], want[:3])
    assert shadow.read("pool", slots[:3], want[:3]) is None
    bad, what = shadow.read("pool", slots, want)
    assert bad.tolist() == [3] and what == "never written"
    shadow.write("pool", slots[3:], want[:1])
    bad, what = shadow.read("pool", slots, want)
    assert bad.tolist() == [3] and what == "written for another token prefix"


def test_a_repeated_prompt_comes_from_the_cache_and_grows_on_its_own():
    """Prompts are cached process-wide (a tag is a pure function of the tokens): a second request
    with the same prompt gets equal tags in its own array, and each grows independently."""
    prompt = [(5 * i + 1) % 89 for i in range(37)]
    first, second = ShadowKV({}), ShadowKV({})  # two runs: the cache outlives a run
    a, b = Owner(), Owner()
    ta = first.request_tags(a, prompt).copy()
    tb = second.request_tags(b, prompt)
    assert tb.tolist() == ta.tolist() == reference(prompt)
    out_a, out_b = [3], [4, 8]
    assert first.request_tags(a, prompt, out_a).tolist() == reference(prompt + out_a)
    assert second.request_tags(b, prompt, out_b[:1]).tolist() == reference(prompt + out_b[:1])
    assert second.request_tags(b, prompt, out_b).tolist() == reference(prompt + out_b)
    assert first.request_tags(a, prompt, out_a).tolist() == reference(prompt + out_a)  # untouched by b
