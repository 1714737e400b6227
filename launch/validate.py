"""``llmrl validate CONFIG [key=value ...]``: check a config without starting anything."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the YAML config to check")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def main(args: argparse.Namespace) -> int:
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"llmrl: {err}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid. The run needs {config.world_size} ranks: 1 client + {config.num_server_ranks} "
          "server ranks.")
    for name, llm in config.llms.items():
        training = f"updater {llm.updater.plugin}, ZeRO-{llm.training.zero_stage}" if llm.updater else "inference only"
        print(f"  {name}: {llm.type} model {llm.model}, {llm.replicas} replica(s) x {llm.tensor_parallel} "
              f"tensor-parallel rank(s) on {llm.devices if isinstance(llm.devices, str) else list(llm.devices)}, "
              f"{llm.dtype}, heads {sorted(llm.heads) or 'none'}, {training}")
    return 0
