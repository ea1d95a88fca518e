"""``noria bench prefix`` on the tiny model: the workload's ids, the JSON shape, the hit rates.

Timings are never asserted (the machines are noisy); only the shape of the figures and the hit
rates, which depend on the prefix cache and the routing and not on the clock.
"""

from __future__ import annotations

import json

from noria.bench import prefix
from noria.cli import build_parser
from noria.models import load_tokenizer


def test_turns_extend_the_previous_prompt_exactly(tiny_model_dir):
    conversations = prefix.build_conversations(load_tokenizer(tiny_model_dir), sessions=2, turns=3)
    conv = conversations[0]
    assert conv.turns == 3 and len(conversations) == 2
    assert conversations[0].first != conversations[1].first  # sessions do not share their questions
    output = [5, 6, 7]
    second = prefix.next_prompt(conv, conv.first, output, turn=1)
    assert second[: len(conv.first) + 3] == conv.first + output
    assert second[len(conv.first) + 3 :] == conv.closing + conv.follow_ups[0]
    # An answer that already ends with the end-of-message token is not closed twice.
    ended = prefix.next_prompt(conv, conv.first, output + conv.closing[:1], turn=1)
    assert ended == conv.first + output + conv.closing + conv.follow_ups[0]


def test_bench_prefix_json_and_hit_rates(tiny_model_dir, tmp_path):
    path = tmp_path / "prefix.json"
    results = prefix.run(str(tiny_model_dir), sessions=2, turns=3, new_tokens=4, json_path=str(path), dtype="float32")
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "prefix" and doc["results"] == results
    assert {"command", "date", "machine"} <= set(doc)
    rows = {(r["case"].rsplit(" ", 1)[1], r["metric"]): r for r in results}
    metrics = ("ttft_ms", "ttft_p50_ms", "ttft_p90_ms", "hit_rate", "hit_rate_turn2plus", "decode_tokens_per_s")
    assert set(rows) == {(f"engines={n}", m) for n in (1, 2) for m in metrics}
    for row in results:
        assert set(row) == {"case", "metric", "noria", "peers", "bound"}
        assert row["case"].startswith(f"{tiny_model_dir} fp32 sessions=2 turns=3 new=4 ")
    assert set(rows["engines=1", "ttft_ms"]["peers"]) == {"block_match", "share_partial", "block_size_1", "no_cache"}
    assert set(rows["engines=2", "ttft_ms"]["peers"]) == {"no_cache", "load_routing"}
    assert all(rows[n, "ttft_ms"]["noria"] > 0 for n in ("engines=1", "engines=2"))
    for engines in ("engines=1", "engines=2"):
        hit = rows[engines, "hit_rate"]
        assert 0 < hit["noria"] < 1
        assert hit["peers"]["no_cache"] == 0
    assert 0 <= rows["engines=2", "hit_rate"]["peers"]["load_routing"] < 1
    later = rows["engines=1", "hit_rate_turn2plus"]
    # Token granularity serves every earlier token but the last one: what block size 1 serves, and
    # more than whole blocks of 16 (each turn's tail is not lost); sharing the block matches the same.
    assert later["noria"] == later["peers"]["block_size_1"] == later["peers"]["share_partial"]
    assert later["noria"] > later["peers"]["block_match"]
    assert rows["engines=1", "decode_tokens_per_s"]["noria"] > 0


def test_cli_registers_bench_prefix():
    from noria.bench import parse_bench_args, prefix

    argv = ["--model", "m", "--sessions", "2", "--turns", "3", "--new-tokens", "4", "--engines", "1", "--json", "x.json"]
    top, rest = build_parser().parse_known_args(["bench", "prefix", *argv])
    assert top.bench_command == "prefix" and top.parses_rest and rest == argv
    assert top.handler.__name__ == "bench_prefix"
    module, args = parse_bench_args("prefix", rest)
    parsed = (args.model, args.sessions, args.turns, args.new_tokens, args.json, args.dtype, args.engines)
    assert parsed == ("m", 2, 3, 4, "x.json", "auto", "1") and module is prefix
