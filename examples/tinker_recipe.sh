#!/usr/bin/env bash
# Run one tinker-cookbook recipe, unmodified, against llmrl's Tinker service: start `llmrl tinker` with CONFIG,
# wait until it answers, run the recipe with model_name set to the config's model folder and renderer_name=role_colon,
# then stop the service. Extra arguments go to the recipe (chz key=value arguments).
#   examples/tinker_recipe.sh configs/tinker.yaml tinker_cookbook.recipes.chat_sl.train dataset=... log_path=...
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=$1; MODULE=$2; shift 2
DIR=$(mktemp -d)
# a key of this run only, in the environment (never on a command line, which every user of the machine can read)
export TINKER_API_KEY=tml-$(.venv/bin/python -c "import secrets; print(secrets.token_urlsafe(24))")
.venv/bin/llmrl tinker --config "$CONFIG" --port 0 --ready-file "$DIR/url" \
    --save-dir "$DIR/saved" > "$DIR/service.log" 2>&1 &
SERVICE=$!
trap 'kill $SERVICE 2>/dev/null; wait $SERVICE 2>/dev/null || true' EXIT
until [ -f "$DIR/url" ]; do   # written once the service answers
    kill -0 $SERVICE 2>/dev/null || { cat "$DIR/service.log"; exit 1; }
    sleep 0.5
done
MODEL=$(.venv/bin/python -c "
import sys, yaml
from llmrl.engine.model.store.loading import resolve_model_path
llm = next(iter(yaml.safe_load(open(sys.argv[1]))['llms'].values()))
print(resolve_model_path(llm.get('tokenizer') or llm['model']))" "$CONFIG")
echo "llmrl tinker: serving at $(cat "$DIR/url") (log: $DIR/service.log); running $MODULE" >&2
# An existing log_path is the user's: the recipe stops rather than delete it (pass behavior_if_log_dir_exists=resume
# or =delete yourself to choose otherwise).
EXISTING=raise
for arg in "$@"; do [[ $arg == behavior_if_log_dir_exists=* ]] && EXISTING=; done
TINKER_BASE_URL=$(cat "$DIR/url") TINKER_TELEMETRY=0 \
    .venv/bin/python -m "$MODULE" model_name="$MODEL" renderer_name=role_colon \
    ${EXISTING:+behavior_if_log_dir_exists=$EXISTING} "$@"
