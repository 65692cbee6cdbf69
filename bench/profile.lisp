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

;;; What a kept-alive request costs ours, for the matrix's summary: system
;;; calls (strace -c over every thread of the server process) and bytes
;;; consed, per request served.

(defun strace-total-calls (file)
  "The total of the calls column of the strace -c summary in FILE, or NIL."
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings "(?m)^[\\d.\\s]+?\\s(\\d+)\\s+(?:\\d+\\s+)?total\\s*$"
                                                      (uiop:read-file-string file)))))
    (and match (parse-integer (aref match 0)))))

(defun measure-request-costs (core &key (connections 100) (seconds 3))
  "Ours in a process of its own from CORE, /yo kept alive over CONNECTIONS
connections for SECONDS under strace -c -f: system calls and bytes consed
per request served, as a plist (NIL values when strace is missing)."
  (let* ((port (free-port))
         (process (launch-server (second *servers*) port 0 core nil))
         (workload (list :delay-ms 0 :close nil :connections connections)))
    (unwind-protect
         (when (wait-until-serving port)
           (wrk port workload 2)
           (uiop:with-temporary-file (:pathname summary)
             (let* ((before (lisp-counters port t))
                    (strace (ignore-errors
                             (uiop:launch-program (list "strace" "-c" "-f" "-o" (namestring summary)
                                                        "-p" (princ-to-string (uiop:process-info-pid process)))
                                                  :output nil :error-output nil))))
               ;; strace attaches to each thread before it counts.
               (sleep 1)
               (wrk port workload seconds)
               (let ((after (lisp-counters port nil)))
                 (when strace
                   (uiop:terminate-process strace)
                   (uiop:wait-process strace))
                 (let ((served (- (getf after :requests) (getf before :requests))))
                   (when (plusp served)
                     (list :requests served
                           :system-calls-per-request (let ((calls (and strace (strace-total-calls summary))))
                                                       (and calls (/ calls served)))
                           :bytes-consed-per-request (round (- (getf after :consed) (getf before :consed))
                                                            served))))))))
      (stop-server process))))

(defun append-request-costs (directory core)
  "Measure what a kept-alive request costs ours and add it to DIRECTORY's
summary.md and to the output."
  (let* ((costs (measure-request-costs core))
         (text (format nil "~%What a kept-alive request costs ours (0 ms handler, 100 connections, wrk for ~
                            3 s, under strace -c -f): ~:[-~;~:*~,1F~] system calls and ~:[-~;~:*~D~] bytes ~
                            consed per request (~D requests).~%"
                       (getf costs :system-calls-per-request) (getf costs :bytes-consed-per-request)
                       (getf costs :requests))))
    (with-open-file (out (concatenate 'string directory "summary.md") :direction :output :if-exists :append)
      (write-string text out))
    (write-string text)
    directory))
