"""A plan report says what the chosen plan does, in words a reader finds in the model.

Notes about tensor sizes the search did not choose are left out, ops are named by module
(not by the trace's `linear_17`), an offline plan never says that something "ran", counts
agree with their nouns, and the progress bar draws only on a terminal.
"""

from __future__ import annotations

import io
import re

import pytest

from autopar.cli import Progress, main

LLAMA = "llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=96,vocab=256,seq=32"  # 8 heads


def _explain(capsys, *argv) -> str:
    assert main(["explain", *argv]) == 0
    return capsys.readouterr().out


def test_notes_speak_only_of_the_chosen_tensor_size(capsys):
    # at world 64 the search tries tp 16, 32 and 64, which 8 heads refuse; it chooses less
    text = _explain(capsys, LLAMA, "--world", "64")
    tp = int(re.search(r"mesh .* tp=(\d+)", text).group(1))
    assert tp <= 8
    noted = [int(size) for size in re.findall(r"note: .*?tp=(\d+)", text)]
    assert all(size == tp for size in noted), text
    assert "heads, which do not split" not in text


def test_an_offline_plan_names_modules_and_never_says_ran(capsys):
    text = _explain(capsys, "moe-tiny", "--world", "2", "--tp", "2")
    assert "runs replicated:" in text
    replicated = text.split("runs replicated:")[1]
    assert "blocks.0.moe (topk)" in replicated
    assert not re.search(r"\b[a-z_]+_\d+\b", replicated), replicated  # no traced node names
    assert not re.search(r"\bran\b", text), [ln for ln in text.splitlines() if " ran " in ln]


def test_a_count_agrees_with_its_noun(capsys):
    text = _explain(capsys, LLAMA, "--world", "8", "--pp", "1", "--microbatches", "1")
    assert "1 micro-batch of" in text and "1 micro-batches" not in text
    text = _explain(capsys, LLAMA, "--world", "2", "--pp", "2", "--microbatches", "4",
                    "--batch", "8")
    assert "4 micro-batches of 2" in text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, draws", [(io.StringIO(), False), (_Terminal(), True)],
                         ids=["redirected", "terminal"])
def test_the_progress_bar_draws_only_on_a_terminal(stream, draws):
    progress = Progress(stream, after_s=0.0)
    for done in range(0, 101, 10):
        progress(done, 100)
    progress.close()
    assert ("searching [" in stream.getvalue()) is draws
    if not draws:
        assert stream.getvalue() == ""


def test_a_redirected_stderr_gets_no_bar(capsys, monkeypatch):
    import autopar.cli as cli

    monkeypatch.setattr(cli.Progress.__init__, "__defaults__", (None, 0.0))  # draw at once
    assert main(["explain", LLAMA, "--world", "8"]) == 0
    assert "searching" not in capsys.readouterr().err
