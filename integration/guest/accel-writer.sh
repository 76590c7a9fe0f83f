#!/bin/sh
# Verifying random writer of the test guest (see integration/src/supervised.rs).
# Usage: accel-writer DEV WORKERS BLOCKS
dev=$1; NW=$2; BL=$3; short=${dev#/dev/}
rm -f /tmp/stop
( read line < /dev/ttyS0; touch /tmp/stop ) &
worker() {
  w=$1; base=$((w*BL)); errs=0; n=0
  dd if=/dev/zero of=/tmp/c$w bs=4k count=$BL 2>/dev/null
  dd if=/tmp/c$w of=$dev bs=4k seek=$base oflag=direct conv=notrunc 2>/dev/null || errs=$((errs+1))
  touch /tmp/ready$w
  while [ ! -e /tmp/stop ]; do
    off=$((RANDOM % BL))
    dd if=/dev/urandom of=/tmp/b$w bs=4k count=1 2>/dev/null
    dd if=/tmp/b$w of=$dev bs=4k seek=$((base+off)) oflag=direct conv=notrunc 2>/dev/null || errs=$((errs+1))
    dd if=/tmp/b$w of=/tmp/c$w bs=4k seek=$off conv=notrunc 2>/dev/null
    r=$((RANDOM % BL))
    dd if=$dev of=/tmp/r$w bs=4k skip=$((base+r)) count=1 iflag=direct 2>/dev/null || errs=$((errs+1))
    dd if=/tmp/c$w of=/tmp/e$w bs=4k skip=$r count=1 2>/dev/null
    cmp -s /tmp/r$w /tmp/e$w || errs=$((errs+1))
    n=$((n+1))
  done
  dd if=$dev of=/tmp/f$w bs=4k skip=$base count=$BL iflag=direct 2>/dev/null || errs=$((errs+1))
  cmp -s /tmp/f$w /tmp/c$w || errs=$((errs+1))
  echo "$n $errs" > /tmp/done$w
}
w=0; while [ $w -lt $NW ]; do worker $w & w=$((w+1)); done
while [ $(ls /tmp/ready* 2>/dev/null | wc -l) -lt $NW ]; do sleep 0.1; done
echo READY
while [ ! -e /tmp/stop ]; do
  sleep 2
  echo progress=$(cat /proc/diskstats | awk -v s=$short '$3==s{print $8}')
done
wait
n=0; e=0; w=0; files=""
while [ $w -lt $NW ]; do
  set -- $(cat /tmp/done$w); n=$((n+$1)); e=$((e+$2)); files="$files /tmp/c$w"; w=$((w+1))
done
k=$(dmesg | grep -c -i -E 'I/O error|not a head') 
echo iterations=$n
echo errors=$e
echo kernel_errors=$k
echo sectors=$(cat /sys/block/$short/size)
echo md5=$(cat $files | md5sum | cut -d' ' -f1)
if [ $e -eq 0 ] && [ $k -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
