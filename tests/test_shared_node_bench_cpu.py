"""benchmarks/shared_node.py end to end on the CPU (``--cpu-smoke``): two jobs side by side on a
simulated node, both finishing, each job's host figures (needed, held, the node's available
memory) recorded per step, and the verdicts on the node's bound (issue 48 §3)."""

from __future__ import annotations

from _bench_util import run_smoke


def test_shared_node_smoke_runs_two_jobs_and_records_their_host_figures() -> None:
    result = run_smoke("shared_node.py", "shared_node_pytest", "--node-gib", "0.001")
    jobs, verdicts = result["jobs"], result["verdicts"]
    assert set(jobs) == {"first", "second"}
    assert verdicts["finished"] == {"first": True, "second": True}, verdicts
    assert verdicts["within_node"] is True and verdicts["node_total_bytes"] == int(0.001 * (1 << 30))
    for role, job in jobs.items():
        assert len(job["steps"]) == result["args"]["steps"], f"{role}: {job['steps']}"
        last = job["steps"][-1]
        assert last["plan"] is not None, f"{role} never planned"
        for key in ("ms", "host_needed_bytes", "host_peak_bytes", "node_available_bytes"):
            assert last[key] is not None, f"{role} did not record {key}"
        assert job["host"]["node_source"].startswith("simulated"), job["host"]
