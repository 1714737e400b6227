"""``python -m llmrl.launch``: what the DeepSpeed launcher runs on every rank.

Every rank leaves through ``os._exit`` once its work is done (after the Python ``atexit`` handlers on rank 0,
where the user's script ran): C++ destructors at interpreter exit can abort a process whose torch, gloo or
tokenizer threads are still joinable, turning a finished run into exit code 134."""

from llmrl.engine.processes import leave
from llmrl.launch.rank import main

leave(main(), run_atexit=True)
