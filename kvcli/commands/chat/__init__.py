"""`kvcli chat`: a multi-turn REPL over the model's chat template, replies streamed through the paged
KV cache. session.py holds the conversation and per-turn figures, repl.py the input loop, commands
and output, live.py the dashboard shown while a reply streams (--live, /live), run.py the entry
point.

Every turn submits the whole conversation (rendered by the chat template) as a new request, so the
prefix cache reuses the earlier turns' blocks; the status line after a turn says how many prompt
tokens were hits and how much prefill that saved."""

from kvcli.commands.chat.run import run_chat
from kvcli.commands.chat.session import ChatArgs

__all__ = ["ChatArgs", "run_chat"]
