#!/usr/bin/env bash
# stdin -> stdout without Gloo's connection reports. Gloo (JAX's CPU collectives) prints
# "[Gloo] Rank R is connected to N peer ranks. Expected number of connected peer ranks is : N"
# for every collective group, piece by piece with std::cout, so groups that connect at the same
# time interleave their pieces: "[Gloo] Rank [Gloo] Rank 2 is connected to ..." then a line
# starting "1 is connected to ...". A line is dropped when it is made of those pieces alone,
# so a line with anything else in it (a log record, "is NOT connected to: [3]") is kept.
piece='\[Gloo\] Rank |[0-9]+| is connected to | peer ranks\. |Expected number of connected peer ranks is : '
grep --line-buffered -vxE "($piece)+" || true
