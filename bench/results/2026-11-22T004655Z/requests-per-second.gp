set title "Requests/s (log scale); labels: ratio to Hunchentoot"
set style fill solid 0.85 border -1
set logscale y
set grid ytics
set key outside bottom center horizontal
set xtics rotate by -20 scale 0
set xrange [-0.6:3.6]
bw = 0.26666668
set terminal svg size 1400,700 dynamic font 'sans,11'
set output "bench/results/2026-11-22T004655Z/requests-per-second.svg"
plot "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+-0.26666668):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "park at once", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+-0.26666668):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.0):5:(bw) with boxes lc rgb "#1f77b4" title "one read without waiting, then park", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.0):5:6 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.26666668):7:(bw) with boxes lc rgb "#2ca02c" title "wait up to 1 ms, then park", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.26666668):7:8 with labels offset 0,0.7 font ',8' notitle
set terminal pngcairo size 1400,700 font 'sans,10'
set output "bench/results/2026-11-22T004655Z/requests-per-second.png"
plot "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+-0.26666668):3:(bw):xtic(2) with boxes lc rgb "#7f7f7f" title "park at once", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+-0.26666668):3:4 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.0):5:(bw) with boxes lc rgb "#1f77b4" title "one read without waiting, then park", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.0):5:6 with labels offset 0,0.7 font ',8' notitle, \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.26666668):7:(bw) with boxes lc rgb "#2ca02c" title "wait up to 1 ms, then park", \
     "bench/results/2026-11-22T004655Z/requests-per-second.dat" using ($1+0.26666668):7:8 with labels offset 0,0.7 font ',8' notitle
