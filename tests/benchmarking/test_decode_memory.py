"""The decoding-memory benchmark: its cache filling, its cells and its table (no long runs;
timings belong to benchmarks/RESULTS.md)."""

from dataclasses import asdict, replace

import pytest
import torch

import attnkit as ak
from attnkit.benchmarking import decode_memory as dm
from attnkit.kv_cache import LayerCache
from attnkit.linear_family import RecurrentCache
from attnkit.modern import LatentCache, StreamingCache

S = replace(dm.sizes(True), contexts=(40,), new_tokens=3, warmup=1, chunk=16, window=20)


def _context(n):
    return torch.cat(list(dm._chunks(n, S, 0)), dim=-2)


@pytest.mark.parametrize("form", ["mha", "gqa", "streaming"])
def test_fill_stores_what_a_causal_prefill_stores(form):
    n = 40
    layer = dm._layer(form, S)
    filled = dm._cache(form, S)
    with torch.no_grad():
        dm.fill(form, layer, filled, n, S)
        x = _context(n)
        if form == "streaming":
            ref = StreamingCache(S.sinks, S.window)
            layer(x, mask=ref.step_mask(n), cache=ref)
        else:
            ref = LayerCache()
            layer(x, mask=ak.masks.causal(n), cache=ref)
    assert len(filled) == len(ref) == (S.sinks + S.window if form == "streaming" else n)
    torch.testing.assert_close(filled.k, ref.k)
    torch.testing.assert_close(filled.v, ref.v)


def test_fill_of_mla_stores_the_latents_and_rotary_keys_of_a_prefill():
    n = 40
    layer = dm._layer("mla", S)
    filled = LatentCache()
    with torch.no_grad():
        dm.fill("mla", layer, filled, n, S)
        ref = LatentCache()
        layer(_context(n), ak.masks.causal(n), cache=ref)
    torch.testing.assert_close(filled.latent, ref.latent)
    torch.testing.assert_close(filled.rope_key, ref.rope_key)


def test_fill_of_a_linear_part_gives_the_state_of_one_causal_pass():
    n = 40
    layer = dm._layer("gated_deltanet", S)
    filled = RecurrentCache()
    with torch.no_grad():
        dm.fill("gated_deltanet", layer, filled, n, S)
        ref = RecurrentCache()
        layer(_context(n), cache=ref)
    assert len(filled) == len(ref) == n
    torch.testing.assert_close(filled.state, ref.state, rtol=1e-4, atol=1e-5)


def test_cell_counts_the_cache_bytes_of_each_form():
    n, f = 40, 4  # float32
    d_h = S.d_model // S.heads
    expected = {
        "mha": 2 * S.heads * d_h * f * n,
        "gqa": 2 * S.kv_heads * d_h * f * n,
        "mla": (S.kv_rank + S.rope_dim) * f * n,
        "mla-absorbed": (S.kv_rank + S.rope_dim) * f * n,
        "streaming": 2 * S.heads * d_h * f * (S.sinks + S.window),
        "retention": S.heads * d_h * d_h * f,
        "mamba2": S.heads * d_h * d_h * f,
    }
    for form, nbytes in expected.items():
        out = dm.run_cell({"form": form, "n": n, "sizes": asdict(S)})
        assert out["cache_bytes"] == nbytes, form
        assert out["step_seconds"] > 0 and out["peak_bytes"] >= out["base_bytes"] > 0


def _rows(text):
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def test_table_gives_ratios_against_mha_at_the_same_context():
    mib = 2**20
    results = [
        # N = 1024: gqa holds a quarter of the cache and decodes 1.5 times as fast
        {"form": "gqa", "n": 1024, "cache_bytes": 1 * mib, "cached_tokens": 1024,
         "peak_bytes": 13 * mib, "base_bytes": 10 * mib, "step_seconds": 0.002,
         "decode_peak_bytes": 12 * mib, "base_rss_bytes": 10 * mib},
        {"form": "mha", "n": 1024, "cache_bytes": 4 * mib, "cached_tokens": 1024,
         "peak_bytes": 18 * mib, "base_bytes": 10 * mib, "step_seconds": 0.003,
         "decode_peak_bytes": 19 * mib, "base_rss_bytes": 11 * mib},
        {"form": "retention", "n": 1024, "error": "over the 900 s limit"},
        # N = 4096 without an mha cell (no ratios) and without a decoding peak
        {"form": "gqa", "n": 4096, "cache_bytes": 4 * mib, "cached_tokens": 4096,
         "peak_bytes": 20 * mib, "base_bytes": 10 * mib, "step_seconds": 0.004,
         "decode_peak_bytes": None, "base_rss_bytes": None},
    ]  # fmt: skip
    rows = _rows(dm.table(results, S))
    assert [(r[0], r[1]) for r in rows] == [
        ("1024", "mha"),  # in FORMS order, whatever the order of the results
        ("1024", "gqa"),
        ("1024", "retention"),
        ("4096", "gqa"),
    ]
    mha, gqa, failed, alone = rows
    assert mha[2:] == ["4.00", "4,096", "1.00", "8.0", "1.00", "8.0", "1.00", "333.3", "1.00"]
    assert gqa[2:] == ["1.00", "1,024", "0.25", "2.0", "0.25", "3.0", "0.38", "500.0", "1.50"]
    assert len(failed) == len(mha) and "over the 900 s limit" in failed[9]
    assert set(failed[2:9]) == {"—"}
    assert alone[5] == alone[6] == alone[8] == alone[10] == "—"
    assert alone[4] == "—" and alone[9] == "250.0"


def test_main_refuses_unknown_forms_and_bad_contexts():
    with pytest.raises(ValueError, match="forms"):
        dm.main(quick=True, forms=["mha", "flash"])
    with pytest.raises(ValueError, match="contexts"):
        dm.main(quick=True, contexts=[0])


def test_main_keeps_each_cells_fastest_round(monkeypatch):
    calls = []

    def fake(case, timeout, module):  # mha: slow then fast; gqa: fails then runs
        calls.append((case["form"], case["n"]))
        first = calls.count((case["form"], case["n"])) == 1
        if case["form"] == "gqa" and first:
            return {"error": "exit 1: killed"}
        seconds = 0.004 if first else 0.002
        return {"cache_bytes": 2**20, "cached_tokens": 8, "peak_bytes": 2, "base_bytes": 1,
                "step_seconds": seconds, "decode_peak_bytes": 2, "base_rss_bytes": 1}  # fmt: skip

    monkeypatch.setattr("attnkit.benchmarking.timing.in_subprocess", fake)
    seen = []
    rows = _rows(dm.main(quick=True, forms=["mha", "gqa"], contexts=[8], rounds=2,
                         progress=seen.append))  # fmt: skip
    assert calls == [("mha", 8), ("gqa", 8)] * 2 and len(seen) == 4
    assert [r[1] for r in rows] == ["mha", "gqa"]
    assert rows[0][9] == rows[1][9] == "500.0"  # 1 / 0.002 s: the faster round
    with pytest.raises(ValueError, match="rounds"):
        dm.main(quick=True, rounds=0)
