#!/bin/sh
# The objects compiled for one CPU capability define code only in hp::kernels::<CAP>:: (their
# entry points). Any other function they define (an inline function of a header, compiled with
# this capability's -m flags) could be bound in place of the portable copy and fault on a CPU
# without the capability.
#   capability_symbols.sh CAP OBJECT...
cap=$1
shift
stray=$(nm -C --defined-only "$@" | grep -E ' [TtWw] ' | grep -v " hp::kernels::$cap::" | grep -v ' [tw] ' || true)
if [ -n "$stray" ]; then
  echo "functions outside hp::kernels::$cap:: in the $cap objects:"
  echo "$stray"
  exit 1
fi
echo "the $cap objects define functions only in hp::kernels::$cap::"
