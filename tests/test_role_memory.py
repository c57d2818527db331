"""The role memory tool: a role built in a fresh process of a given checkout reports its resident
memory; the report table has a column per label and a dash for a role a run left out."""

from __future__ import annotations

from pathlib import Path

from backend.bench.role_memory import measure_once, table

REPO = Path(__file__).resolve().parents[1]


def test_a_role_is_built_in_a_fresh_process_of_the_checkout(tmp_path):
    # create_app connects to nothing while it is built: no Redis server is needed
    result = measure_once(REPO, tmp_path, "tiny-sd2-inpaint", "redis://127.0.0.1:1/0", "api")
    assert result["built"] == "FastAPI" and result["backend"] == str(REPO / "backend")
    assert 0 < result["rss_kib"] <= result["hwm_kib"]


def test_the_table_has_a_column_per_label():
    def entry(rss: float) -> dict:
        return {"rss_mib": rss, "hwm_mib": rss + 10}

    report = {
        "runs": {
            "before": {"roles": {"cpu-worker": entry(677.0), "api": entry(280.4)}},
            "after": {"roles": {"cpu-worker": entry(404.2)}},
        }
    }
    assert table(report).splitlines() == [
        "| role | before MiB (peak) | after MiB (peak) |",
        "| --- | ---: | ---: |",
        "| cpu-worker | 677 (687) | 404 (414) |",
        "| api | 280 (290) | - |",
    ]
