"""`dynprof memory`'s answer and its text: one row per process, the artifact under a snapshot's
row, `what to do` for each failure that has one."""

from __future__ import annotations

from dynprof.cli.memory import MemoryCommand, MemoryResults

SNAPSHOT_ROWS = [
    {
        "pid": 1,
        "rank": 0,
        "job": "j",
        "status": "complete",
        "artifact": "/a/b",
        "summary": {
            "allocated_bytes": 123456789,
            "reserved_bytes": 2**31,
            "capture_s": 0.01,
            "top_site": "x.py:1 in f",
            "top_site_bytes": 5000,
        },
    },
    {"pid": 2, "rank": None, "job": "j", "status": "failed", "error": "no cuda", "help": "use a gpu", "exit_code": 7},
]


def test_snapshot_results_render_as_a_table_with_the_artifact_and_what_to_do():
    # GIVEN a snapshot taken in one process and refused in another
    result = MemoryResults(doc={"results": SNAPSHOT_ROWS}, exit_code=7)
    # WHEN it is rendered
    text = MemoryCommand().render(result)
    # THEN the text is the table the command has always printed, then the failure's help
    assert text == (
        "rank    pid  status    result\n"
        "rank 0  1    complete  117.7 MiB allocated / 2.0 GiB reserved, 0.01 s; top site x.py:1 in f (4.9 KiB)\n"
        "                       /a/b\n"
        "-       2    failed    no cuda\n"
        "  what to do: use a gpu"
    )
    # AND the --json document is the rows, as they were
    assert result.to_json() == {"results": SNAPSHOT_ROWS}


def test_history_results_name_the_policy_now_recording():
    # GIVEN a history request answered by one process
    rows = [{"pid": 1, "rank": 3, "job": "j", "status": "ok", "memory_history": "python:100"}]
    # WHEN it is rendered
    text = MemoryCommand().render(MemoryResults(doc={"results": rows}, history=True))
    # THEN each row says what the process records now
    assert text == "rank    pid  status  result\nrank 3  1    ok      memory history: python:100"
