;;;; Profiling one cell of the matrix: ours serving /yo in this process
;;;; while wrk loads it, sampled by sb-sprof across every thread.  The flat
;;;; report and the bytes consed per request are what a change to the
;;;; request path is judged by first; bench/profiles/ keeps the summaries.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun run-wrk (port connections seconds keep-alive-p)
  "Run wrk against /yo on PORT; its output."
  (uiop:run-program (append (list "wrk" "-t2" (format nil "-c~D" connections) (format nil "-d~Ds" seconds))
                            (unless keep-alive-p (list "-H" "Connection: close"))
                            (list (format nil "http://127.0.0.1:~D/yo" port)))
                    :output :string :ignore-error-status t))

(defun run-profile (&key (connections 100) (seconds 10) (keep-alive-p t) (mode :cpu) (max-samples 40000))
  "Serve /yo with a PARALLEL-EASY-ACCEPTOR in this process, load it with wrk
for SECONDS over CONNECTIONS connections (kept alive, or one request each),
and print wrk's summary, bytes consed per request and sb-sprof's flat
report of every thread, sampling in sb-sprof's MODE: :CPU for where the
time goes, :ALLOC for where the bytes are consed.  True when wrk answered."
  (let ((port (free-port)))
    (start-server :parallel port)
    (unwind-protect
         (progn
           ;; Warm up: the first requests make the pool's threads.
           (run-wrk port connections 2 keep-alive-p)
           (let ((requests-before (counter-requests *counters*))
                 (consed-before (sb-ext:get-bytes-consed))
                 (wrk-output nil))
             (sb-sprof:with-profiling (:max-samples max-samples :mode mode :threads :all :report nil)
               (setf wrk-output (run-wrk port connections seconds keep-alive-p)))
             (let ((requests (- (counter-requests *counters*) requests-before)))
               (format t "~&Cell: 0 ms handler, ~:[one request per connection~;keep-alive~], ~D connections, ~D s, ~(~A~) samples~%~
                          SBCL ~A, ~A~%~%~A~%Bytes consed per request (whole process): ~:[-~;~:*~D~]~%~%"
                       keep-alive-p connections seconds mode (lisp-implementation-version) (machine-type)
                       wrk-output
                       (and (plusp requests) (round (- (sb-ext:get-bytes-consed) consed-before) requests)))
               (sb-sprof:report :type :flat :max 40 :stream *standard-output*)
               (plusp requests))))
      (ht:stop *acceptor*))))
