#!/bin/bash
bash .baseline/mem.sh $OUT/mem.txt & M=$!
LIMIT=565 bash .baseline/run.sh A-a166548 AL-main A-a166548b AL-main2
kill $M
