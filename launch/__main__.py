"""``python -m llmrl.launch``: what the DeepSpeed launcher runs on every rank."""

import sys

from llmrl.launch.rank import main

sys.exit(main())
