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
;;; calls and bytes consed per request served.  The calls are counted by
;;; the kernel's tracepoints (perf stat), which leave the server's timing
;;; alone; strace -c -f, the fallback where perf cannot count, stops each
;;; thread at each call, which leaves workers idle and adds the pool's own
;;; futex calls to the count (0.56 a request, bench/profiles/2026-11-24-
;;; system-call-counts.txt).

(defparameter *named-system-calls* '("recvfrom" "sendto" "epoll_wait" "epoll_ctl" "futex")
  "The system calls whose counts the summary names beside the total: a
kept-alive request's own, and the pool's.")

(defun perf-counting-command (pid seconds output)
  "perf stat counting PID's system calls, in all and those of
*NAMED-SYSTEM-CALLS*, for SECONDS, as CSV into OUTPUT."
  (list* "perf" "stat" "-x" "," "-o" (namestring output) "-p" (princ-to-string pid)
         "-e" "raw_syscalls:sys_enter"
         (append (loop for name in *named-system-calls*
                       collect "-e" collect (format nil "syscalls:sys_enter_~A" name))
                 (list "--" "sleep" (princ-to-string seconds)))))

(defun read-perf-counts (file)
  "The counts in perf stat's CSV output FILE, as an alist from the system
call's name (\"all\" for raw_syscalls) to its count; NIL when it counted
nothing (perf missing, or not allowed to count)."
  (let ((counts (loop for line in (ignore-errors (uiop:read-file-lines file))
                      for fields = (uiop:split-string line :separator ",")
                      for count = (ignore-errors (parse-integer (first fields)))
                      for event = (third fields)
                      when (and count event)
                        collect (cons (if (string= event "raw_syscalls:sys_enter")
                                          "all"
                                          (subseq event (length "syscalls:sys_enter_")))
                                      count))))
    (and (assoc "all" counts :test #'string=) counts)))

(defun strace-counting-command (pid output)
  (list "strace" "-c" "-f" "-o" (namestring output) "-p" (princ-to-string pid)))

(defun read-strace-counts (file)
  "The counts of strace -c's summary in FILE, as READ-PERF-COUNTS gives them."
  (let ((text (or (ignore-errors (uiop:read-file-string file)) "")))
    (flet ((calls (name)
             ;; % time, seconds, usecs/call, calls, errors (if any), name.
             (let ((match (nth-value 1 (cl-ppcre:scan-to-strings
                                        (format nil "(?m)^\\s*[\\d.]+\\s+[\\d.]+\\s+\\d+\\s+(\\d+)\\s+(?:\\d+\\s+)?~A\\s*$" name)
                                        text))))
               (and match (parse-integer (aref match 0))))))
      (let ((total (calls "total")))
        (when total
          (cons (cons "all" total)
                (loop for name in *named-system-calls*
                      collect (cons name (or (calls name) 0)))))))))

(defun count-system-calls (pid seconds load)
  "Call LOAD while the system calls of process PID are counted, for about
SECONDS: the counts as READ-PERF-COUNTS gives them and the tool that
counted (:PERF, or :STRACE where perf cannot, LOAD then called again), or
NIL."
  (uiop:with-temporary-file (:pathname output)
    (flet ((count-with (command reader &optional stop)
             (let ((counter (ignore-errors (uiop:launch-program command :output nil :error-output nil))))
               (when counter
                 ;; Both attach to each thread before they count.
                 (sleep 1)
                 (funcall load)
                 (when stop (uiop:terminate-process counter))
                 (uiop:wait-process counter)
                 (funcall reader output)))))
      (let ((counts (count-with (perf-counting-command pid (+ seconds 2) output) #'read-perf-counts)))
        (if counts
            (values counts :perf)
            (let ((counts (count-with (strace-counting-command pid output) #'read-strace-counts t)))
              (and counts (values counts :strace))))))))

(defun measure-request-costs (core &key (connections 100) (seconds 3))
  "Ours in a process of its own from CORE, /yo kept alive over CONNECTIONS
connections for SECONDS: as a plist, the requests served, the system calls
per request (in all, and :CALLS, each named one's per request, as an
alist), the tool that counted them, and the bytes consed per request; NIL
values for the calls when neither perf nor strace could count."
  (let* ((port (free-port))
         (process (launch-server (second *servers*) port 0 core nil))
         (workload (list :delay-ms 0 :close nil :connections connections)))
    (unwind-protect
         (when (wait-until-serving port)
           (wrk port workload 2)
           (let ((before nil)
                 (after nil))
             ;; The counters are read around each load: where perf runs and
             ;; counts nothing, the load runs again under strace; where
             ;; neither can count, it runs once uncounted.
             (flet ((load-server ()
                      (setf before (lisp-counters port t))
                      (wrk port workload seconds)
                      (setf after (lisp-counters port nil))))
               (multiple-value-bind (counts tool)
                   (count-system-calls (uiop:process-info-pid process) seconds #'load-server)
                 (unless after
                   (load-server))
               (let ((served (- (getf after :requests) (getf before :requests))))
                 (when (plusp served)
                   (list :requests served
                         :counted-by tool
                         :system-calls-per-request (let ((all (cdr (assoc "all" counts :test #'string=))))
                                                     (and all (/ all served)))
                         :calls (loop for (name . count) in counts
                                      unless (string= name "all")
                                        collect (cons name (/ count served)))
                         :bytes-consed-per-request (round (- (getf after :consed) (getf before :consed))
                                                          served))))))))
      (stop-server process))))

(defun append-request-costs (directory core)
  "Measure what a kept-alive request costs ours and add it to DIRECTORY's
summary.md and to the output."
  (let* ((costs (measure-request-costs core))
         (text (format nil "~%What a kept-alive request costs ours (0 ms handler, 100 connections, wrk for ~
                            3 s, system calls counted by ~A): ~:[-~;~:*~,2F~] system calls~@[ (~{~{~A ~,2F~}~^, ~})~] ~
                            and ~:[-~;~:*~D~] bytes consed per request (~D requests).~%"
                       (case (getf costs :counted-by)
                         (:perf "the kernel's tracepoints, perf stat")
                         (:strace "strace -c -f, which slows every thread: perf could not count")
                         (t "nobody: neither perf nor strace could"))
                       (getf costs :system-calls-per-request)
                       (loop for (name . per-request) in (getf costs :calls)
                             collect (list name per-request))
                       (getf costs :bytes-consed-per-request)
                       (getf costs :requests))))
    (with-open-file (out (concatenate 'string directory "summary.md") :direction :output :if-exists :append)
      (write-string text out))
    (write-string text)
    directory))
