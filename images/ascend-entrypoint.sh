#!/usr/bin/env bash
# Entry point of the Atlas images: load the CANN environment, then start `dsv41 serve`.
# `docker run IMAGE` starts no login shell, so the set_env.sh scripts the vllm-ascend base
# image sources from ~/.bashrc would not run; they are sourced here instead.
set -eo pipefail

for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [[ -f "$env_script" ]]; then
        # shellcheck disable=SC1090  # the path is only known inside the image
        source "$env_script"
    fi
done

# jemalloc, as the vllm-ascend images preload it for interactive shells
jemalloc="/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2"
if [[ -f "$jemalloc" ]]; then
    export LD_PRELOAD="${jemalloc}${LD_PRELOAD:+:$LD_PRELOAD}"
fi

exec dsv41 serve "$@"
