"""The report's memory table: each rank's bytes of a run record (sync.memory), read from the committed records."""
import json
from pathlib import Path

from ddtrain.report.sections import memory_blocks

RESULTS = Path(__file__).resolve().parents[2] / "results" / "sharding"


def test_memory_table_has_a_row_per_rank_in_mb():
    records = [(RESULTS / name, json.loads((RESULTS / name).read_text())) for name in ("ddp_adamw.json",
                                                                                        "zero2_adamw.json")]
    (_, note), (_, header, rows) = memory_blocks(records, RESULTS)
    assert "optimizer steps" in note and header[3:6] == ["parameters (MB)", "gradients (MB)", "optimizer state (MB)"]
    assert [r[1] for r in rows] == ["ddp"] * 3 + ["zero2"] * 3
    ddp, zero2 = records[0][1]["comm"][0]["memory"], records[1][1]["comm"][0]["memory"]
    assert float(rows[3][4]) == round(zero2["gradient_bytes"] / 1e6, 3)
    assert zero2["gradient_bytes"] <= 0.4 * ddp["gradient_bytes"]


def test_records_without_memory_add_nothing():
    assert memory_blocks([(RESULTS / "x.json", {"strategy": "ddp", "comm": [{"rank": 0}]})], RESULTS) == []
