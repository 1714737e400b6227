"""``llmrl validate CONFIG [key=value ...] [--strict-devices] [--resolved]``: check a config without starting anything
(``--config CONFIG`` works too, as in ``llmrl run``).

Everything is checked as ``llmrl run`` would, and the merged config (the file with the overrides applied) is
printed, or with ``--resolved`` every key with its value, its default and who set it (:mod:`llmrl.launch.resolved`);
GPUs the config names but this machine lacks
are a note, not an error, though (configs are often checked on a login node without GPUs);
``--strict-devices`` makes them an error. ``llmrl run`` always refuses a config whose GPUs are missing.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="the YAML config to check")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same, as llmrl run takes it")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("--strict-devices", "--strict_devices", dest="strict_devices", action="store_true",
                        help="fail if this machine lacks the GPUs the config names (default: a note)")
    parser.add_argument("--resolved", action="store_true",
                        help="print every key of the config with the value the run gets, its default, and whether "
                             "the file or an override set it")


def parse_argv(argv: list[str]) -> argparse.Namespace:
    """Options and overrides in any order (plain argparse stops taking overrides after an option)."""
    parser = argparse.ArgumentParser(prog="llmrl validate", description="check a config without starting anything")
    add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    if args.config and args.config_option:  # a positional taken as the config was the first override
        args.overrides, args.config = [args.config, *args.overrides], args.config_option
    args.config = args.config or args.config_option
    if not args.config:
        parser.error("name the config: llmrl validate CONFIG (or --config CONFIG) [key=value ...]")
    return args


def main(args: argparse.Namespace) -> int:
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError

    try:
        config = load_config(args.config, args.overrides, check_devices=args.strict_devices)
    except ConfigError as err:
        print(f"llmrl: {err}", file=sys.stderr)
        return 2
    print(f"{args.config}: valid. The run needs {config.world_size} ranks: 1 client + {config.num_server_ranks} "
          "server ranks.")
    for name, llm in config.llms.items():
        training = (f"updater {llm.updater.plugin}, ZeRO-{llm.training.zero_stage}" if llm.updater else
                    f"trained from the script (forward_backward), ZeRO-{llm.training.zero_stage}" if llm.trainable
                    else "inference only")
        print(f"  {name}: {llm.type} model {llm.model}, {llm.replicas} replica(s) x {llm.tensor_parallel} "
              f"tensor-parallel rank(s) on {llm.devices if isinstance(llm.devices, str) else list(llm.devices)}, "
              f"{llm.dtype}, heads {sorted(llm.heads) or 'none'}, {training}")
    for note in device_notes(config) if not args.strict_devices else []:
        print(f"  note: {note}")
    if args.resolved:
        from llmrl.engine.config.loading import load_yaml
        from llmrl.launch.resolved import resolved_table

        print(resolved_table(config, load_yaml(args.config), args.overrides), end="")
    else:
        print(merged(args.config, args.overrides), end="")
    return 0


def merged(path: str, overrides: list[str]) -> str:
    """The config file with the overrides applied, as YAML (what the run reads before defaults are filled)."""
    import yaml

    from llmrl.engine.config.loading import apply_overrides, load_yaml

    data = apply_overrides(load_yaml(path), overrides, [])
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return "merged config (the file and the overrides; unset keys take their defaults):\n" + "".join(
        f"  {line}\n" for line in text.splitlines())


def device_notes(config) -> list[str]:
    """What ``llmrl run`` would refuse on this machine because GPUs are missing (a note for ``validate``)."""
    on_gpu = [name for name, llm in config.llms.items() if llm.on_gpu]
    if not on_gpu:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [f"llms.{name}.devices: {_devices(config.llms[name].devices)} asks for GPUs, but CUDA is not available "
            "on this machine: the devices were not checked (run on the GPU nodes, or pass --strict-devices to make "
            "this an error)" for name in on_gpu]


def _devices(devices) -> str:
    return devices if isinstance(devices, str) else str(list(devices))

