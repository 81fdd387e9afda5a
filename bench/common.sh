# Shell helpers for the bench scripts: source it.

# The median of the numbers given (the lower one of the middle two for an even count).
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
