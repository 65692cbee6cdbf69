set title "Requests/s (log scale); labels: ratio to Hunchentoot"
set style fill solid 0.85 border -1
set logscale y
set grid ytics
set key outside bottom center horizontal
set xtics rotate by -20 scale 0
set xrange [-0.6:7.6]
bw = 0.16
set terminal svg size 1400,700 dynamic font 'sans,11'
set output "bench/results/2026-11-22T013837Z/requests-per-second.svg"
plot "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.32):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "Hunchentoot easy-acceptor", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.32):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.16):5:(bw) with boxes lc rgb "#1f77b4" title "parallel-easy-acceptor", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.16):5:6 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.0):7:(bw) with boxes lc rgb "#2ca02c" title "parallel, blocking engine", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.0):7:8 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.16):9:(bw) with boxes lc rgb "#d62728" title "Portable AllegroServe", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.16):9:10 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.32):11:(bw) with boxes lc rgb "#ff7f0e" title "nginx, 2 workers", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.32):11:12 with labels offset 0,0.7 font ',8' notitle
set terminal pngcairo size 1400,700 font 'sans,10'
set output "bench/results/2026-11-22T013837Z/requests-per-second.png"
plot "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.32):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "Hunchentoot easy-acceptor", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.32):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.16):5:(bw) with boxes lc rgb "#1f77b4" title "parallel-easy-acceptor", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+-0.16):5:6 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.0):7:(bw) with boxes lc rgb "#2ca02c" title "parallel, blocking engine", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.0):7:8 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.16):9:(bw) with boxes lc rgb "#d62728" title "Portable AllegroServe", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.16):9:10 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.32):11:(bw) with boxes lc rgb "#ff7f0e" title "nginx, 2 workers", \
     "bench/results/2026-11-22T013837Z/requests-per-second.dat" using ($1+0.32):11:12 with labels offset 0,0.7 font ',8' notitle
