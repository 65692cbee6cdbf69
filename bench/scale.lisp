;;;; Scaling out: N processes of ours on one port with SO_REUSEPORT, and the
;;;; same N processes behind nginx as upstreams (kept-alive connections to
;;;; them), each measured by wrk against one process alone, in one run.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun core-count ()
  (or (ignore-errors (parse-integer (uiop:run-program '("nproc") :output :string) :junk-allowed t))
      1))

(defun launch-ours (port delay-ms core &key reuse-port)
  (uiop:launch-program
   (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
         "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench:serve :parallel ~D :delay-ms ~D :reuse-port ~S)"
                          port delay-ms reuse-port))
   :output nil :error-output nil))

(defun measure-scale-cell (processes front delay-ms &key core seconds connections)
  "Requests/s (and wrk's parsed summary) of PROCESSES processes of ours,
FRONT :DIRECT (one port, SO_REUSEPORT) or :NGINX (upstreams), at DELAY-MS."
  (let* ((port (free-port))
         (upstream-ports (loop repeat processes collect (if (eq front :direct) port (free-port))))
         (servers (loop for upstream-port in upstream-ports
                        collect (launch-ours upstream-port delay-ms core :reuse-port (eq front :direct))))
         (nginx (and (eq front :nginx) (launch-nginx port :upstream-ports upstream-ports)))
         (workload (list :delay-ms delay-ms :close nil :connections connections)))
    (unwind-protect
         (progn
           (dolist (upstream-port (if (eq front :direct) (list port) upstream-ports))
             (wait-until-serving upstream-port))
           ;; Every process of one port must listen before the measure.
           (sleep 3)
           (when nginx (wait-until-serving port))
           (wrk port workload 2)
           (parse-wrk (wrk port workload seconds)))
      (when nginx (stop-server nginx))
      (mapc #'stop-server servers))))

(defun run-scale (&key core (seconds 5) (connections 100))
  "Measure 1, 2 and one-per-core processes of ours, on one port with
SO_REUSEPORT and behind nginx, at 0 ms and 1 ms handlers with kept-alive
connections; print the table of requests/s and ratios to one process
alone.  True when every cell answered."
  (let ((counts (remove-duplicates (list 1 2 (core-count))))
        (rows '()))
    (dolist (delay-ms '(0 1))
      (let ((baseline nil))
        (dolist (processes counts)
          (dolist (front '(:direct :nginx))
            (format t "~&~D ms, ~D ~:*~[~;process~:;processes~], ~(~A~): measuring ~D s~%"
                    delay-ms processes front seconds)
            (finish-output)
            (let* ((cell (measure-scale-cell processes front delay-ms
                                             :core core :seconds seconds :connections connections))
                   (rate (getf cell :requests-per-second)))
              (when (and (= processes 1) (eq front :direct))
                (setf baseline rate))
              (push (list delay-ms processes front rate (and baseline (plusp baseline) (/ rate baseline))
                          (getf cell :p99-ms)
                          (+ (getf cell :connect-errors) (getf cell :read-errors)
                             (getf cell :write-errors) (getf cell :timeout-errors))
                          (getf cell :non-2xx))
                    rows))))))
    (setf rows (nreverse rows))
    (format t "~&~%Scaling out, ~D kept-alive connections (wrk -t2), ~D core~:P, ~A:~%~%~
               | handler | processes | in front | requests/s | ratio to 1 process alone | p99 ms | socket errors | non-2xx |~%~
               |---|---:|---|---:|---:|---:|---:|---:|~%"
            connections (core-count) (utc-timestamp))
    (loop for (delay-ms processes front rate ratio p99 errors non-2xx) in rows
          do (format t "| ~D ms | ~D | ~:[nginx (upstreams)~;none (SO_REUSEPORT)~] | ~D | ~:[-~;~:*~,2Fx~] | ~:[-~;~:*~,1F~] | ~D | ~D |~%"
                     delay-ms processes (eq front :direct) (round rate) ratio p99 errors non-2xx))
    (every (lambda (row) (plusp (fourth row))) rows)))
