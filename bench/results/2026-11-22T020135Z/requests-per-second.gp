set title "Requests/s (log scale); labels: ratio to parallel, blocking engine"
set style fill solid 0.85 border -1
set logscale y
set grid ytics
set key outside bottom center horizontal
set xtics rotate by -20 scale 0
set xrange [-0.6:7.6]
bw = 0.4
set terminal svg size 1400,700 dynamic font 'sans,11'
set output "bench/results/2026-11-22T020135Z/requests-per-second.svg"
plot "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+-0.2):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "parallel, blocking engine", \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+-0.2):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+0.2):5:(bw) with boxes lc rgb "#1f77b4" title "parallel-easy-acceptor", \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+0.2):5:6 with labels offset 0,0.7 font ',8' notitle
set terminal pngcairo size 1400,700 font 'sans,10'
set output "bench/results/2026-11-22T020135Z/requests-per-second.png"
plot "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+-0.2):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "parallel, blocking engine", \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+-0.2):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+0.2):5:(bw) with boxes lc rgb "#1f77b4" title "parallel-easy-acceptor", \
     "bench/results/2026-11-22T020135Z/requests-per-second.dat" using ($1+0.2):5:6 with labels offset 0,0.7 font ',8' notitle
