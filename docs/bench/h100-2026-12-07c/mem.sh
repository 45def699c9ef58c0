#!/bin/bash
# bash .baseline/mem.sh FILE: every 0.5 s, the time, the GPU's used MiB and each compute process's MiB with its module
while true; do
  t=$(date +%s.%N | cut -c1-14)
  tot=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)
  apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | while IFS=', ' read pid mib; do m=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -o -- '-m [a-z_]*' | cut -c4-); echo -n "$m:$mib "; done)
  echo "$t $tot $apps" >> "$1"
  sleep 0.5
done
