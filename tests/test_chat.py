"""`kvcli chat` with the real bundled model: one-line flag errors, scripted use through a pipe (replies
on stdout, status on stderr, /save), per-turn prefix-cache hits with and without --no-prefix-cache,
context overflow with and without --truncate, and real terminal sessions under tmux (streamed reply,
status line, /blocks, Ctrl-C mid-reply, /quit; the full dashboard while a reply streams after /live).

The tmux test needs the `tmux` binary (CI: `apt-get install -y tmux`); it is skipped without it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from terminal import Tmux, after, at_prompt

from kvcli.cli import app

# The installed script (like a user runs it); `python -c` from the repo root would put the repo's
# kernels/ folder on sys.path as `kernels`.
_SCRIPT = Path(sys.executable).with_name("kvcli")
KVCLI = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-c", "from kvcli.cli import main; main()"]
STATUS = re.compile(r"[\d,]+ prompt tokens . [\d,]+ generated . [\d.,]+ tok/s decode")
PREFIX = re.compile(r"prefix hit ([\d,]+) tokens . prefill saved ([\d,]+) tokens")
# The bundled model loads in ~3 s; the limits are generous for a busy 2-core CI machine.
RUN_TIMEOUT = 240


def chat(lines: list[str], *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([*KVCLI, "chat", *args], input="".join(line + "\n" for line in lines),
                          capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=timeout,
                          cwd=tempfile.gettempdir())


def status_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if STATUS.search(line)]


def assert_clean(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr


# --- flags: one line, no model load --------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--block-size", "24"], "--block-size"),
    (["--kv-budget", "lots"], "--kv-budget"),
    (["--model", "/nonexistent/model.gguf"], "model not found"),
])
def test_chat_bad_flags_one_line(args, needle):
    one_line_error(CliRunner().invoke(app, ["chat", *args], input="Hello\n"), needle)


def test_chat_help_lists_options():
    r = CliRunner().invoke(app, ["chat", "--help"])
    assert r.exit_code == 0
    for opt in ("--system", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--truncate",
                "--model", "--kv-budget", "--max-model-len", "--live", "--no-live", "/live"):
        assert opt in r.stdout, opt


@pytest.mark.parametrize("flags,live", [([], False), (["--live"], True), (["--no-live"], False)])
def test_chat_live_flag_reaches_chat_args(monkeypatch, flags, live):
    seen = []
    monkeypatch.setattr("kvcli.commands.chat.run_chat", lambda a, fail: seen.append(a) or 0)
    r = CliRunner().invoke(app, ["chat", *flags])
    assert r.exit_code == 0, r.output
    assert [a.live for a in seen] == [live]


# --- through a pipe --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_pipe_two_replies_status_on_stderr_and_save(tmp_path):
    saved = tmp_path / "chat.json"
    p = chat(["Hello", "/nosuch", "What is 2+2?", "/save /nonexistent-dir/chat.json", f"/save {saved}",
              "/stats", "/blocks", "/help", "/live"], "--temperature", "0", "--max-tokens", "24")
    assert p.returncode == 0, p.stderr
    assert_clean(p)
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "user", "assistant"]
    assert data["messages"][0]["content"] == "Hello" and data["messages"][2]["content"] == "What is 2+2?"
    turns = data["turns"]
    assert len(turns) == 2
    assert 0 < turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"]  # turn 2 carries turn 1
    assert all(1 <= t["generated_tokens"] <= 24 and not t["interrupted"] for t in turns)
    replies = [m["content"] for m in data["messages"][1::2]]
    assert all(r.strip() for r in replies)
    # stdout is the two replies, each ended by a newline, and nothing else (no prompt, banner, status).
    assert p.stdout == "".join(r.lstrip() + "\n" for r in replies), p.stdout
    # Status, notices and views on stderr.
    assert len(status_lines(p.stderr)) == 2, p.stderr
    err_lines = p.stderr.splitlines()
    assert sum("unknown command /nosuch" in line for line in err_lines) == 1
    assert sum("cannot write /nonexistent-dir/chat.json" in line for line in err_lines) == 1
    assert "KV blocks used (peak)" in p.stderr  # /stats and the exit summary
    held = re.search(r"conversation: 2 turns holding ([\d,]+) tokens of the 8,192-token context", p.stderr)  # /stats
    assert held and int(held.group(1).replace(",", "")) > turns[1]["prompt_tokens"], p.stderr  # both replies in it
    assert re.search(r"blocks x 16 tokens", p.stderr)  # /blocks
    assert "kvcli chat: 2 turns" in p.stderr
    assert re.search(r"/live +toggle the full dashboard", p.stderr)  # /help
    assert "live dashboard on (shown only when stderr is a terminal)" in p.stderr


def test_chat_refuses_a_line_that_is_not_text(tmp_path):
    """Bytes that are not UTF-8, or a NUL, in an input line: a one-line note, nothing sent, the session goes on
    (continue and perplexity refuse the same bytes in a file); the text once reached the model as U+FFFD."""
    saved = tmp_path / "chat.json"
    data = b"bad \xff\xfe bytes\nnul\x00byte\nHello\n/save " + str(saved).encode() + b"\n"
    p = subprocess.run([*KVCLI, "chat", "--temperature", "0", "--max-tokens", "4"], input=data, capture_output=True,
                       timeout=RUN_TIMEOUT, cwd=tempfile.gettempdir())
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8 (byte 0xff at character 4): not sent" in err, err
    assert "a NUL byte in the line, expected text: not sent" in err, err
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert [m["content"] for m in data["messages"][::2]] == ["Hello"]
    assert len(status_lines(err)) == 1


def prefix_figures(stderr: str) -> list[tuple[int, int]]:
    """(prefix hit, prefill saved) of each status line."""
    out = []
    for line in status_lines(stderr):
        m = PREFIX.search(line)
        assert m, line
        out.append((int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_chat_second_turn_hits_the_prefix_cache(tmp_path, prefix_cache):
    """Turn 2 resubmits turn 1's prompt and reply: with prefix caching its first blocks are hits and
    their prefill is skipped; with --no-prefix-cache nothing is."""
    saved = tmp_path / "chat.json"
    flags = [] if prefix_cache else ["--no-prefix-cache"]
    p = chat(["Hello", "What is 2+2?", f"/save {saved}"], "--temperature", "0", "--max-tokens", "4", *flags)
    assert p.returncode == 0, p.stderr
    assert_clean(p)
    turns = json.loads(saved.read_text(encoding="utf-8"))["turns"]
    figures = [(t["prefix_hit_tokens"], t["prefill_tokens_saved"]) for t in turns]
    assert prefix_figures(p.stderr) == figures, p.stderr  # the status lines say what /save wrote
    assert figures[0] == (0, 0)  # nothing cached before the first turn
    hits, saved_tokens = figures[1]
    if prefix_cache:
        # Whole 16-token blocks of turn 1's prompt come back (the prompt alone is over 16 tokens).
        assert hits > 0 and hits % 16 == 0 and hits < turns[1]["prompt_tokens"], figures
        assert saved_tokens == hits, figures
        assert f"prefix-cache hits {hits:,} tokens" in p.stderr  # the exit summary's total
    else:
        assert figures[1] == (0, 0), figures


SEA = "Tell me about " + "the sea and the sky, " * 17 + "please."  # ~107 tokens
MOON = "Now tell me about " + "the moon and the stars, " * 17 + "please."
PASTE = "Summarize this: " + "the sea and the sky, " * 60  # ~365 tokens: more than the context allows
SMALL_CTX = ["--temperature", "0", "--max-tokens", "16", "--max-model-len", "256", "--system", "Be brief."]


@pytest.mark.slow
def test_chat_context_overflow_notice_and_reset(tmp_path):
    """With --kv-window none a conversation past the context is refused with a notice (the default goes on
    through the bounded cache: tests/test_kv_window_cli.py)."""
    saved = tmp_path / "chat.json"
    p = chat([SEA, MOON, "/reset", MOON, PASTE, f"/save {saved}"], *SMALL_CTX, "--kv-window", "none")
    assert p.returncode == 0, p.stderr
    assert_clean(p)
    full = [line for line in p.stderr.splitlines() if line.startswith("context full")]
    assert len(full) == 1 and "/reset" in full[0] and "256-token context" in full[0], p.stderr
    too_long = [line for line in p.stderr.splitlines() if line.startswith("message too long")]
    assert len(too_long) == 1, p.stderr
    assert len(status_lines(p.stderr)) == 2  # SEA, then MOON after /reset
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert [m["content"] for m in data["messages"][::2]] == [MOON]
    assert all(t["prompt_tokens"] + 16 <= 256 for t in data["turns"])
    # One reply (empty for a refused message) per message line.
    assert p.stdout.count("\n") == 4 and p.stdout.split("\n")[1] == "" and p.stdout.split("\n")[3] == ""


@pytest.mark.slow
def test_chat_truncate_drops_oldest_turns(tmp_path):
    saved = tmp_path / "chat.json"
    p = chat([SEA, MOON, f"/save {saved}"], *SMALL_CTX, "--truncate")
    assert p.returncode == 0, p.stderr
    assert_clean(p)
    dropped = [line for line in p.stderr.splitlines() if "dropped the 1 oldest turn" in line]
    assert len(dropped) == 1, p.stderr
    assert len(status_lines(p.stderr)) == 2
    data = json.loads(saved.read_text(encoding="utf-8"))
    assert data["dropped_turns"] == 1
    assert [m["content"] for m in data["messages"][::2]] == [MOON]


# --- a real terminal: tmux (tests/terminal.py) ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs the tmux binary for a real terminal "
                    "(apt-get install -y tmux)")
def test_chat_in_a_terminal_stream_blocks_ctrl_c_quit():
    # 200 tokens per reply: the story below streams long enough to be interrupted on any machine; the
    # short question ends by itself in a few tokens.
    cmd = shlex.join([*KVCLI, "chat", "--temperature", "0", "--max-tokens", "200"])
    t = Tmux(f"{cmd}; echo KVCLI_EXIT=$?; sleep 120")
    try:
        t.wait(at_prompt, "the first prompt", timeout=180)

        t.type_line("Say hi in three words.")
        screen = t.wait(lambda s: len(status_lines(s)) == 1 and at_prompt(s), "the first reply and its status")
        reply = [line for line in after(screen, "you> Say hi in three words.") if line.strip()]
        assert STATUS.search(reply[-2]) and reply[-1].rstrip() == "you>", screen
        assert any(re.search(r"[A-Za-z]{2}", line) for line in reply[:-2]), screen  # the streamed reply

        t.type_line("/blocks")
        screen = t.wait(lambda s: "last turn (" in s and at_prompt(s), "the block map")
        assert re.search(r"blocks x 16 tokens", screen)

        t.type_line("Write a long story about a lighthouse keeper.")

        def streaming(s: str) -> bool:
            body = [line for line in after(s, "you> Write a long story") if line.strip() and "thinking" not in line]
            return any(re.search(r"[A-Za-z]{3}", line) for line in body)

        t.wait(streaming, "the story to start streaming", timeout=120)
        t.send("C-c")
        screen = t.wait(lambda s: "[interrupted]" in s and at_prompt(s), "the interrupted reply and the prompt")
        assert "Traceback" not in screen and "KVCLI_EXIT" not in screen  # the session survived

        t.send("C-c")  # at the prompt: a hint, not an exit
        t.wait(lambda s: "use /quit or Ctrl-D" in s and at_prompt(s), "the Ctrl-C hint")

        t.type_line("/quit")
        screen = t.wait(lambda s: "KVCLI_EXIT=" in s, "the exit", timeout=60)
        assert "KVCLI_EXIT=0" in screen and "kvcli chat: 2 turns" in screen, screen
        assert "Traceback" not in screen
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs the tmux binary for a real terminal "
                    "(apt-get install -y tmux)")
def test_chat_a_pasted_block_is_one_message(tmp_path):
    """Three pasted lines are one message (a terminal sends each pasted newline as Enter); a pasted last line
    without its newline waits in the editor for Enter, and goes with the rest."""
    cmd = shlex.join([*KVCLI, "chat", "--temperature", "0", "--max-tokens", "8"])
    t = Tmux(f"{cmd}; echo KVCLI_EXIT=$?; sleep 120")
    try:
        t.wait(at_prompt, "the first prompt", timeout=180)
        t.paste("Line one of my paste.\nLine two: summarize.\nLine three end.\n")
        t.wait(lambda s: len(status_lines(s)) == 1 and at_prompt(s), "one reply")
        t.paste("Another paste,\nits last line unfinished")
        time.sleep(1.0)
        assert len(status_lines(t.screen())) == 1  # nothing sent before Enter
        t.send("Enter")
        t.wait(lambda s: len(status_lines(s)) == 2 and at_prompt(s), "the second reply")
        t.type_line(f"/save {tmp_path / 'chat.json'}")
        t.wait(lambda s: (tmp_path / "chat.json").exists() and at_prompt(s), "the transcript")
        users = [m["content"] for m in json.loads((tmp_path / "chat.json").read_text())["messages"]
                 if m["role"] == "user"]
        assert users == ["Line one of my paste.\nLine two: summarize.\nLine three end.",
                         "Another paste,\nits last line unfinished"], users
        t.type_line("/quit")
        screen = t.wait(lambda s: "KVCLI_EXIT=" in s, "the exit", timeout=60)
        assert "KVCLI_EXIT=0" in screen and "kvcli chat: 2 turns" in screen and "Traceback" not in screen, screen
    finally:
        t.close()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs the tmux binary for a real terminal "
                    "(apt-get install -y tmux)")
def test_chat_keys_typed_during_a_reply_wait_for_the_prompt():
    """Keys typed while a reply streams are not echoed into it; they show at the next prompt, and Enter sends
    them (the terminal's echo is off while the reply streams, back on after)."""
    cmd = shlex.join([*KVCLI, "chat", "--temperature", "0", "--max-tokens", "300"])
    t = Tmux(f"{cmd}; echo KVCLI_EXIT=$?; sleep 120")
    try:
        t.wait(at_prompt, "the first prompt", timeout=180)
        t.type_line("Write a long story about a lighthouse keeper.")

        def streaming(s: str) -> bool:
            body = [line for line in after(s, "you> Write a long story") if line.strip() and "thinking" not in line]
            return any(re.search(r"[A-Za-z]{3}", line) for line in body)

        t.wait(streaming, "the reply to start streaming", timeout=120)
        t.send("-l", "/stats")
        screen = t.wait(lambda s: len(status_lines(s)) == 1 and "you> /stats" in s, "the typed-ahead keys at the prompt")
        assert screen.count("/stats") == 1, screen  # not in the reply too
        t.send("Enter")
        t.wait(lambda s: "conversation: 1 turn" in s and at_prompt(s), "/stats run")
        t.type_line("/quit")
        screen = t.wait(lambda s: "KVCLI_EXIT=" in s, "the exit", timeout=60)
        assert "KVCLI_EXIT=0" in screen and "Traceback" not in screen, screen
    finally:
        t.close()


def saw_dashboard(s: str) -> bool:
    return "KV blocks" in s and "KV fragmentation" in s and "throughput & latency" in s


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs the tmux binary for a real terminal "
                    "(apt-get install -y tmux)")
def test_chat_live_dashboard_while_a_reply_streams(tmp_path):
    """/live, then a reply: the dashboard is up while it streams, the reply prints above it, keys typed
    meanwhile and Ctrl-C leave the screen intact (echoed, they would shift rich's redraw by a row), and
    once the reply stops the screen holds exactly the reply as kept: no line twice, no leftover panel."""
    saved = tmp_path / "chat.json"
    # A reply long enough to still be streaming when Ctrl-C comes (~100 tok/s here since the C kernels:
    # 200 tokens were over before the keys below were typed).
    cmd = shlex.join([*KVCLI, "chat", "--temperature", "0", "--max-tokens", "1500"])
    t = Tmux(f"{cmd}; echo KVCLI_EXIT=$?; sleep 120", width=100, height=60)
    try:
        t.wait(at_prompt, "the first prompt", timeout=180)
        t.type_line("/live")
        t.wait(lambda s: "live dashboard on" in s and at_prompt(s), "the /live notice")

        t.type_line("Write a long story about a lighthouse keeper.")

        def streaming(s: str) -> bool:
            body = after(s, "you> Write a long story")
            head = next((i for i, line in enumerate(body) if line.startswith("kvcli · step")), None)
            # ~200 characters of reply above it: past the story's first line break.
            return (head is not None and saw_dashboard("\n".join(body[head:]))
                    and len(re.sub(r"\s+", "", "".join(body[:head]))) >= 200)

        screen = t.wait(streaming, "the dashboard and the reply's first lines", timeout=180)
        assert "prefix cache" in screen and "KV pool" in screen, screen  # throughput and memory panels
        for key in "typed":  # a user typing while the reply streams, between dashboard refreshes
            t.send("-l", key)
            time.sleep(0.3)
        t.send("C-c")
        screen = t.wait(lambda s: "[interrupted]" in s and at_prompt(s), "the interrupted reply and the prompt")
        t.type_line(f"/save {saved}")
        t.wait(lambda s: "saved 1 turn" in s and at_prompt(s), "/save")
        msg = json.loads(saved.read_text(encoding="utf-8"))["messages"][1]
        assert msg.get("interrupted") and msg["content"].strip(), msg
        # Between the message and the status line: the reply as kept, once. rich's line wrapping
        # under the dashboard may only have changed whitespace.
        body = after(screen, "you> Write a long story")
        shown = "\n".join(body[:next(i for i, line in enumerate(body) if STATUS.search(line))])
        squash = lambda x: re.sub(r"\s+", "", x)  # noqa: E731
        assert squash(shown) == squash(msg["content"]), (msg["content"], screen)

        t.type_line("/quit")
        screen = t.wait(lambda s: "KVCLI_EXIT=" in s, "the exit", timeout=60)
        assert "KVCLI_EXIT=0" in screen and "Traceback" not in screen, screen
    finally:
        t.close()
