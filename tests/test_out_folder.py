"""`--out` is the run's own (issue 34): nothing is written through a symlink
planted there, a second run on the same `--out` is refused, a full disk ends in
one line with nothing partial left, and Ctrl-C keeps every finished algorithm."""

import errno
import fcntl
import json
import os

import pytest

from pflax._src.cli import checks
from pflax._src.cli import main as cli
from pflax._src.cli import runs as cli_runs
from pflax._src.simulation import records

TINY = ["--clients", "4", "--rounds", "1", "--model", "mlp", "--local-epochs", "1",
        "--no-progress", "--no-compilation-cache"]
LOCK_FILE = getattr(checks, "LOCK_FILE", ".pflax-run.lock")
PLANTED = ("results.json", "results.json.tmp", "accuracy.png", "output_norms.png",
           "fedavg-seed0.ckpt", "fedavg-seed0.ckpt.tmp", ".pflax-write-test")


def _victims(tmp_path, out):
  """A file outside `out` for each planted name, and the symlink to it."""
  victims = tmp_path / "victims"
  victims.mkdir()
  out.mkdir()
  for name in PLANTED:
    (victims / name).write_text("precious")
    os.symlink(victims / name, out / name)
  return victims


def test_symlinks_planted_in_out_are_replaced_never_followed(tmp_path):
  out = tmp_path / "out"
  victims = _victims(tmp_path, out)
  assert cli.main(TINY + ["--algorithms", "fedavg", "--checkpoint-every", "1",
                          "--out", str(out)]) == 0
  assert all((victims / name).read_text() == "precious" for name in PLANTED)
  for name in ("results.json", "accuracy.png", "fedavg-seed0.ckpt"):
    assert not os.path.islink(out / name) and (out / name).stat().st_size > 0
  assert json.loads((out / "results.json").read_text())["runs"][0]["algorithm"] == (
      "fedavg")
  assert not [n for n in os.listdir(out) if n.endswith(".tmp") and not
              os.path.islink(out / n)]


def test_write_file_replaces_a_symlink_and_leaves_no_temporary(tmp_path):
  victim = tmp_path / "victim"
  victim.write_text("precious")
  os.symlink(victim, tmp_path / "results.json")
  records.write_json(str(tmp_path / "results.json"), {"a": 1})
  assert victim.read_text() == "precious"
  assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1}
  assert sorted(os.listdir(tmp_path)) == ["results.json", "victim"]


def test_a_second_run_on_the_same_out_is_one_line(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the first run holds it
  try:
    with pytest.raises(SystemExit, match=r"^pflax-run: --out .* is in use by another "
                       "pflax-run") as error:
      cli.main(TINY + ["--algorithms", "fedavg", "--out", str(out)])
  finally:
    os.close(fd)
  assert "\n" not in str(error.value)
  assert not (out / "results.json").exists()


def test_the_lock_is_held_while_the_run_writes_anything(tmp_path, monkeypatch):
  """Every file a run writes in `--out` (the results and the plots; not the
  write test of its checks, before the lock) is written while its lock is
  held: another process's `flock` of it would be refused at each of those
  moments (a second open file is another `flock` owner, even in this
  process)."""
  out = tmp_path / "out"
  write, held = records.write_file, {}

  def checking_write(path, data):
    if os.path.basename(path) == ".pflax-write-test":
      return write(path, data)
    fd = os.open(out / LOCK_FILE, os.O_RDONLY)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      held[os.path.basename(path)] = False
    except BlockingIOError:
      held[os.path.basename(path)] = True
    finally:
      os.close(fd)
    return write(path, data)
  monkeypatch.setattr(records, "write_file", checking_write)
  assert cli.main(TINY + ["--algorithms", "fedavg", "--out", str(out)]) == 0
  assert {"results.json", "accuracy.png", "output_norms.png"} <= set(held), held
  assert all(held.values()), held


def test_a_planted_lock_symlink_is_refused(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  os.symlink(tmp_path / "elsewhere", out / LOCK_FILE)
  with pytest.raises(SystemExit, match="^pflax-run: --out .*cannot open its lock"):
    cli.main(TINY + ["--algorithms", "fedavg", "--out", str(out)])
  assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_full_disk_is_one_line_and_leaves_nothing_partial(tmp_path, monkeypatch,
                                                            checkpointed):
  calls = []

  def full(fd):   # the disk fills after --out's write test
    calls.append(fd)
    if len(calls) > 1:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  out = tmp_path / "out"
  flags = ["--checkpoint-every", "1"] if checkpointed else []
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(SystemExit, match="^pflax-run: cannot write .*"
                     "No space left on device") as error:
    cli.main(TINY + ["--algorithms", "fedavg", "--out", str(out)] + flags)
  assert "\n" not in str(error.value)
  assert sorted(os.listdir(out)) == [LOCK_FILE]   # nothing partial
  assert len(calls) == 2   # it stopped at the first write: the checkpoint or results


def test_ctrl_c_writes_every_algorithm_that_finished(tmp_path, monkeypatch):
  sweep = cli_runs._sweep   # pylint: disable=protected-access

  def interrupted_at_local(name, *args):
    if name == "local":
      raise KeyboardInterrupt
    return sweep(name, *args)
  monkeypatch.setattr(cli_runs, "_sweep", interrupted_at_local)
  out = tmp_path / "out"
  assert cli.main(TINY + ["--algorithms", "fedavg", "local", "--out", str(out)]) == 130
  saved = json.loads((out / "results.json").read_text())
  assert [run["algorithm"] for run in saved["runs"]] == ["fedavg"]
