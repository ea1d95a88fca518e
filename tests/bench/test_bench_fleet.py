"""`noria bench fleet --tiny --cases push` on the tiny model: the push case runs with both transports
against the raw gloo broadcast, and the JSON has the benchmark shape (docs/architecture.md).

CPU; starts two ``noria serve`` subprocesses and gloo receivers. The launcher case needs Ray in its
own network namespace and the engines case two RL runs: not run here (the RL paths they time are
tested in tests/launch/test_fleet.py and tests/launch/test_ray.py). No timing assertions: a tiny model's figures
on a shared machine mean nothing, only the plumbing is checked.
"""

import json

from noria.cli import main


def test_bench_fleet_push_writes_both_transports_against_the_primitive(tmp_path, tiny_model_dir):
    out = tmp_path / "fleet.json"
    code = main(["bench", "fleet", "--tiny", "--model", str(tiny_model_dir), "--cases", "push",
                 "--work-dir", str(tmp_path / "work"), "--json", str(out)])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "fleet" and {"command", "date", "machine", "cpu"} <= set(doc)
    rows = doc["results"]
    names = ["1 engine(s) (ipc)", "1 engine(s) (broadcast)", "2 engine(s) (ipc)", "2 engine(s) (broadcast)"]
    assert [(r["case"].split(" push to ")[1].split(" vs ")[0], r["metric"]) for r in rows] == [
        (name, metric) for name in names for metric in ("push_s", "push_packed_s")]
    for row in rows:
        assert set(row) == {"case", "metric", "noria", "peers", "bound"}
        assert row["noria"] > 0 and row["bound"] > 0
    for served, packed in zip(rows[::2], rows[1::2]):  # packed again only after serving the new version
        assert packed["noria"] >= served["noria"]
