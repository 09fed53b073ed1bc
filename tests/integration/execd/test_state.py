"""Baseline, state check and restore over HTTP."""

import os

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(fresh_daemon):
    root = fresh_daemon.workdir
    (root / "src").mkdir()
    (root / "src" / "a.py").write_text("print('a')\n")
    (root / "README").write_text("readme\n")
    (root / "link").symlink_to("src/a.py")
    return fresh_daemon, fresh_daemon.client(), root


def changes(report, key):
    return sorted(
        (i["area"], i["change"], i.get("path") or i.get("name") or i.get("cmdline"))
        for i in report[key]
    )


def test_check_and_restore_need_a_baseline(ws):
    _, c, _ = ws
    for route in ("/v1/state-check", "/v1/restore"):
        status, doc = c.request("POST", route, {})
        assert status == 409 and doc["error"]["code"] == "no_baseline"


def test_clean_right_after_baseline(ws):
    _, c, root = ws
    b = c.post("/v1/baseline")
    assert b["ok"] and b["root"] == str(root) and b["files"] == 2
    assert c.post("/v1/state-check")["clean"] is True


def test_restorable_changes_are_classified_and_undone(ws):
    _, c, root = ws
    c.post("/v1/baseline")
    mtime = (root / "src" / "a.py").stat().st_mtime_ns
    c.exec(
        "cd src; export NEWVAR=1; myfn() { :; }; sleep 60 & mkdir -p new/deep; "
        "echo x > new/deep/f; echo y > extra.txt; chmod 600 ../README; touch a.py; "
        "ln -sfn ../README ../link"
    )
    report = c.post("/v1/state-check")
    assert report["clean"] is False and report["unrestorable"] == []
    got = changes(report, "restorable")
    for expected in [
        ("files", "added", str(root / "src/new")),
        ("files", "added", str(root / "src/extra.txt")),
        ("files", "metadata_changed", str(root / "README")),
        ("files", "touched", str(root / "src/a.py")),
        ("files", "link_changed", str(root / "link")),
        ("processes", "added", "sleep 60"),
        ("session", "cwd_changed", str(root / "src")),
        ("session", "env_added", "NEWVAR"),
    ]:
        assert expected in got
    assert not any(p.endswith("new/deep/f") for _, _, p in got)  # collapsed under new/
    restored = c.post("/v1/restore")
    assert restored["clean"] is True and restored["failed"] == 0
    assert not (root / "src" / "new").exists() and not (root / "src" / "extra.txt").exists()
    assert oct((root / "README").stat().st_mode & 0o777) == oct(0o644)
    assert (root / "src" / "a.py").stat().st_mtime_ns == mtime
    assert os.readlink(root / "link") == "src/a.py"
    after = c.exec("pwd; echo ${NEWVAR-unset}; type myfn >/dev/null 2>&1 || echo nofn; jobs")
    assert after["stdout"] == f"{root}\nunset\nnofn\n"
    assert c.post("/v1/state-check")["clean"] is True


def test_unrestorable_changes_stay_reported(ws):
    _, c, root = ws
    c.post("/v1/baseline")
    c.exec("echo changed >> src/a.py; rm README")
    report = c.post("/v1/state-check")
    assert changes(report, "unrestorable") == [
        ("files", "deleted", str(root / "README")),
        ("files", "modified", str(root / "src/a.py")),
    ]
    restored = c.post("/v1/restore")
    assert restored["clean"] is False and restored["unrestorable_count"] == 2


def test_content_change_with_same_mtime_is_caught(ws):
    _, c, root = ws
    c.post("/v1/baseline")
    c.exec(
        "cp -p src/a.py /tmp/keep-$$; printf 'print(1)\\n' > src/a.py; "
        "touch -r /tmp/keep-$$ src/a.py; rm /tmp/keep-$$"
    )
    assert ("files", "modified", str(root / "src/a.py")) in changes(
        c.post("/v1/state-check"), "unrestorable"
    )


def test_session_env_and_cwd_of_baseline_are_restored(ws):
    _, c, root = ws
    c.exec("cd src; export SETUP=done WEIRD=$'a\\nb\"c$d\\\\e`\\xff'")
    c.post("/v1/baseline")
    c.exec("cd /; unset SETUP; export OTHER=1")
    assert c.post("/v1/restore")["clean"] is True
    assert c.exec("pwd; echo $SETUP ${OTHER-none}")["stdout"] == f"{root}/src\ndone none\n"
    assert c.exec('printf %s "$WEIRD" | od -c | head -1')["stdout"].split()[1:] == [
        "a",
        "\\n",
        "b",
        '"',
        "c",
        "$",
        "d",
        "\\",
        "e",
        "`",
        "377",
    ]


def test_watched_paths_outside_workspace_are_never_restorable(ws, tmp_path):
    _, c, _ = ws
    outside = tmp_path / "etc-like"
    outside.mkdir()
    (outside / "conf").write_text("x")
    c.post("/v1/baseline", {"watch": [str(outside)]})
    c.exec(f"echo y > {outside}/new; chmod 600 {outside}/conf")
    report = c.post("/v1/restore")
    assert report["clean"] is False
    assert {i["area"] for i in report["unrestorable"]} == {"watched"}
    assert (outside / "new").exists()  # execd never touches what it does not own


def test_exclude_and_bad_arguments(ws):
    _, c, root = ws
    c.post("/v1/baseline", {"exclude": ["src"]})
    c.exec("echo z > src/new.txt")
    assert c.post("/v1/state-check")["clean"] is True
    for body in ({"root": "rel"}, {"watch": "x"}, {"watch": ["rel"]}, {"exclude": [1]}):
        assert c.request("POST", "/v1/baseline", body)[0] == 400
    assert c.request("POST", "/v1/baseline", {"root": str(root / "nope")})[0] == 404


def test_baseline_and_check_over_a_thousand_files(ws):
    """Their speed is measured by bench/execd_bench.py (10,000 files); here: correctness."""
    _, c, root = ws
    big = root / "many"
    for d in range(10):
        (big / str(d)).mkdir(parents=True)
        for f in range(100):
            (big / str(d) / f"f{f}.py").write_text(f"x = {d * f}\n" * 20)
    b = c.post("/v1/baseline")
    assert b["files"] >= 1000
    assert c.post("/v1/state-check")["clean"] is True
