#!/bin/bash
bash .baseline/mem.sh $OUT/mem.txt & M=$!
LIMIT=${LIMIT:-420} bash .baseline/run.sh AL-a543b29 AL-main3 L9-main
kill $M
