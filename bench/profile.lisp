;;;; Profiling one cell of the matrix: ours serving /yo in this process
;;;; while wrk loads it, sampled by sb-sprof across every thread.  The flat
;;;; report and the bytes consed per request are what a change to the
;;;; request path is judged by first; bench/profiles/ keeps the summaries.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun run-wrk (port connections seconds keep-alive-p &optional cookie (scheme "http"))
  "Run wrk against /yo on PORT over SCHEME, or against /app/counter with the
Cookie header COOKIE when given; its output."
  (if cookie
      (let ((script (application-wrk-script (uiop:default-temporary-directory) :cookie cookie)))
        (unwind-protect
             (uiop:run-program (list "wrk" "-t2" (format nil "-c~D" connections) (format nil "-d~Ds" seconds)
                                     "--latency" "-s" (namestring script)
                                     (format nil "http://127.0.0.1:~D/app/counter" port))
                               :output :string :error-output :output :ignore-error-status t)
          (delete-file script)))
      (wrk port (list :delay-ms 0 :close (not keep-alive-p) :connections connections) seconds :scheme scheme)))

(defun run-profile (&key (connections 100) (seconds 10) (keep-alive-p t) (mode :cpu) (max-samples 40000)
                         session-count tls)
  "Serve /yo with a PARALLEL-EASY-ACCEPTOR in this process, load it with wrk
for SECONDS over CONNECTIONS connections (kept alive, or one request each),
and print wrk's summary, bytes consed per request and sb-sprof's flat
report of every thread, sampling in sb-sprof's MODE: :CPU for where the
time goes, :ALLOC for where the bytes are consed.  With SESSION-COUNT, the
load is the application cells' returning user's session counter instead
(GET /app/counter with its cookie, kept alive), among SESSION-COUNT
sessions.  With TLS, over HTTPS (a PARALLEL-EASY-SSL-ACCEPTOR, the bench's
certificate).  True when wrk answered."
  (let ((port (free-port))
        (scheme (if tls "https" "http"))
        (certificates (and tls (make-bench-certificate))))
    (if tls
        (start-hunchentoot port 'hrt:parallel-easy-ssl-acceptor
                           :ssl-certificate-file (merge-pathnames "cert.pem" certificates)
                           :ssl-privatekey-file (merge-pathnames "key.pem" certificates))
        (start-server :parallel port))
    (unwind-protect
         (let ((cookie (and session-count (returning-user-cookie port))))
           (when session-count
             (fill-sessions port session-count))
           ;; Warm up: the first requests make the pool's threads.
           (run-wrk port connections 2 keep-alive-p cookie scheme)
           (let ((served-before (getf (hrt:taskmaster-statistics *acceptor*) :requests-served))
                 (consed-before (sb-ext:get-bytes-consed))
                 (wrk-output nil))
             (sb-sprof:with-profiling (:max-samples max-samples :mode mode :threads :all :report nil)
               (setf wrk-output (run-wrk port connections seconds keep-alive-p cookie scheme)))
             (let ((requests (- (getf (hrt:taskmaster-statistics *acceptor*) :requests-served) served-before)))
               (format t "~&Cell: ~:[0 ms handler~;~:*the session counter of a returning user among ~D sessions~], ~
                          ~:[one request per connection~;keep-alive~], ~A, ~D connections, ~D s, ~(~A~) samples~%~
                          SBCL ~A, ~A~%~%~A~%Bytes consed per request (whole process): ~:[-~;~:*~D~]~%~%"
                       session-count keep-alive-p (if tls "HTTPS" "HTTP") connections seconds mode
                       (lisp-implementation-version) (machine-type)
                       wrk-output
                       (and (plusp requests) (round (- (sb-ext:get-bytes-consed) consed-before) requests)))
               (sb-sprof:report :type :flat :max 40 :stream *standard-output*)
               (plusp requests))))
      (ht:stop *acceptor*)
      (when certificates
        (uiop:delete-directory-tree certificates :validate t :if-does-not-exist :ignore)))))

;;; What a kept-alive request costs ours, for the matrix's summary: system
;;; calls and bytes consed per request served, while the connections are
;;; open -- their opening and closing are the connections' cost, not the
;;; requests'.  The calls are counted by the kernel's tracepoints (perf
;;; stat), which leave the server's timing alone, switched on and off
;;; through perf's control fifo around the two readings of the server's
;;; request count; strace -c -f, the fallback where perf cannot count,
;;; counts the whole load instead, and stops each thread at each call,
;;; which leaves workers idle and adds the pool's own futex calls to the
;;; count (0.56 a request, bench/profiles/2026-11-24-system-call-counts.txt).

(defparameter *named-system-calls* '("recvfrom" "sendto" "epoll_wait" "epoll_ctl" "futex")
  "The system calls whose counts the summary names beside the total: a
kept-alive request's own, and the pool's.")

(defun perf-counting-command (pid seconds output control acknowledgement)
  "perf stat counting PID's system calls, in all and those of
*NAMED-SYSTEM-CALLS*, for at most SECONDS, as CSV into OUTPUT: off until
enabled, and off again, through the fifo CONTROL, each command
acknowledged on the fifo ACKNOWLEDGEMENT."
  (list* "perf" "stat" "-x" "," "-o" (namestring output) "-p" (princ-to-string pid)
         "--delay=-1" (format nil "--control=fifo:~A,~A" (namestring control) (namestring acknowledgement))
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

(defun make-fifo (pathname)
  (uiop:run-program (list "mkfifo" (namestring pathname))))

(defun perf-command (control acknowledgements command)
  "Send perf the control COMMAND (enable, disable) on the stream CONTROL and
wait up to 5 s for its acknowledgement on ACKNOWLEDGEMENTS.  True when perf
acknowledged it."
  (write-line command control)
  (finish-output control)
  (handler-case (sb-sys:with-deadline (:seconds 5)
                  ;; perf writes "ack", a newline and a NUL.
                  (search "ack" (or (read-line acknowledgements nil) "")))
    (sb-sys:deadline-timeout () nil)))

(defun read-lisp-counters (stream)
  "LISP-COUNTERS, asked on STREAM, a kept-alive connection to the server:
answered in a fraction of a millisecond, where a curl process takes
several, as many as a thousand requests at this speed, enough to skew a
count of calls per request by a thousandth."
  (format stream "GET /bench-stats HTTP/1.1~C~CHost: 127.0.0.1~C~C~C~C"
          #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed)
  (finish-output stream)
  (let ((length 0))
    (loop for line = (string-right-trim '(#\Return) (read-line stream))
          until (zerop (length line))
          when (and (> (length line) 15) (string-equal "content-length:" line :end2 15))
            do (setf length (parse-integer line :start 15)))
    (let ((body (make-string length)))
      (read-sequence body stream)
      (parse-lisp-counters body))))

(defun perf-failure (output errors)
  "Why perf counted nothing, from its CSV OUTPUT and its ERRORS file: the
first line of either that says so, or NIL."
  (flet ((first-line-with (file test)
           (find-if test (ignore-errors (uiop:read-file-lines file)))))
    (or (first-line-with output (lambda (line) (search "<not" line)))
        (first-line-with errors (lambda (line) (plusp (length (string-trim " " line))))))))

(defun count-with-perf (pid port workload seconds)
  "Load ours (process PID, on PORT) with WORKLOAD for SECONDS and a second
each side, and count its system calls with perf over the middle SECONDS,
reading its counters (LISP-COUNTERS) as counting starts and as it ends.
The counts as READ-PERF-COUNTS gives them and the counters before and
after; when perf could not count, NIL and why."
  (uiop:with-temporary-file (:pathname output)
    (uiop:with-temporary-file (:pathname errors)
      (let* ((folder (uiop:pathname-directory-pathname output))
             (control (merge-pathnames (format nil "perf-control-~D" pid) folder))
             (acknowledgement (merge-pathnames (format nil "perf-acknowledgement-~D" pid) folder)))
        (make-fifo control)
        (make-fifo acknowledgement)
        (unwind-protect
             ;; Opened for reading and writing, a fifo opens at once, whether
             ;; perf has opened it yet or not.
             (with-open-file (commands control :direction :io :if-exists :append)
               (with-open-file (acknowledgements acknowledgement :direction :io :if-exists :append)
                 (usocket:with-client-socket (socket counters "127.0.0.1" port)
                   (let ((counter (ignore-errors
                                   (uiop:launch-program (perf-counting-command pid (+ seconds 10) output
                                                                               control acknowledgement)
                                                        :output nil :error-output errors
                                                        :if-error-output-exists :supersede)))
                         (before nil)
                         (after nil))
                     (if (null counter)
                         (values nil "perf did not start")
                         (let ((load (uiop:launch-program (wrk-command port workload (+ seconds 2))
                                                          :output nil :error-output nil)))
                           ;; wrk's connections are open and busy a second in.
                           (sleep 1)
                           (when (perf-command commands acknowledgements "enable")
                             (setf before (read-lisp-counters counters))
                             (sleep seconds)
                             (when (perf-command commands acknowledgements "disable")
                               (setf after (read-lisp-counters counters))))
                           (uiop:wait-process load)
                           ;; perf writes its counts on SIGINT, not on TERM.
                           (uiop:run-program (list "kill" "-INT" (princ-to-string (uiop:process-info-pid counter)))
                                             :ignore-error-status t)
                           (uiop:wait-process counter)
                           (let ((counts (read-perf-counts output)))
                             (cond ((and counts before after) (values counts before after))
                                   ((null before) (values nil (format nil "perf did not acknowledge enable~@[: ~A~]"
                                                                      (perf-failure output errors))))
                                   ((null after) (values nil (format nil "perf did not acknowledge disable~@[: ~A~]"
                                                                     (perf-failure output errors))))
                                   (t (values nil (or (perf-failure output errors) "perf wrote no counts")))))))))))
          (uiop:delete-file-if-exists control)
          (uiop:delete-file-if-exists acknowledgement))))))

(defun count-with-strace (pid port workload seconds)
  "As COUNT-WITH-PERF, with strace over the whole load of SECONDS; NIL when
strace could not count."
  (uiop:with-temporary-file (:pathname output)
    (let ((counter (ignore-errors (uiop:launch-program (strace-counting-command pid output)
                                                       :output nil :error-output nil))))
      (when counter
        ;; strace attaches to each thread before it counts.
        (sleep 1)
        (let* ((before (lisp-counters port))
               (after (progn (wrk port workload seconds) (lisp-counters port))))
          (uiop:terminate-process counter)
          (uiop:wait-process counter)
          (let ((counts (read-strace-counts output)))
            (and counts before after (values counts before after))))))))

(defparameter *perf-tries* 2
  "How many times MEASURE-REQUEST-COSTS has perf count before it falls back
to strace: perf now and then counts nothing (2 runs in some 20 on
2026-11-26), and strace's count is not the same measurement.")

(defun count-with-perf-tries (pid port workload seconds)
  "COUNT-WITH-PERF's values, tried up to *PERF-TRIES* times, each failure
printed with its reason; NIL when no try counted."
  (loop repeat *perf-tries*
        do (let ((outcome (multiple-value-list
                           (handler-case (count-with-perf pid port workload seconds)
                             (error (condition) (values nil (princ-to-string condition)))))))
             (if (first outcome)
                 (return (values-list outcome))
                 (format t "~&perf could not count: ~A~%" (second outcome))))))

(defun measure-request-costs (core &key (connections 100) (seconds 3))
  "Ours in a process of its own from CORE, /yo kept alive over CONNECTIONS
connections for SECONDS: as a plist, the requests served, the system calls
per request (in all, and :CALLS, each named one's per request, as an
alist), the tool that counted them, and the bytes consed per request; NIL
values for the calls when neither perf nor strace could count."
  (let* ((port (free-port))
         (process (launch-server (second *servers*) port 0 core nil))
         (pid (uiop:process-info-pid process))
         (workload (list :delay-ms 0 :close nil :connections connections)))
    (unwind-protect
         (when (wait-until-serving port)
           (wrk port workload 2)
           (let ((tool :perf))
             (multiple-value-bind (counts before after) (count-with-perf-tries pid port workload seconds)
               (unless counts
                 (setf tool :strace)
                 (multiple-value-setq (counts before after) (count-with-strace pid port workload seconds)))
               (unless counts
                 (setf tool nil
                       before (lisp-counters port)
                       after (progn (wrk port workload seconds) (lisp-counters port))))
               (let ((served (and before after (- (getf after :requests) (getf before :requests)))))
                 (when (and served (plusp served))
                   (list :requests served
                         :counted-by tool
                         :system-calls-per-request (let ((all (cdr (assoc "all" counts :test #'string=))))
                                                     (and all (/ all served)))
                         :calls (loop for (name . count) in counts
                                      unless (string= name "all")
                                        collect (cons name (/ count served)))
                         :bytes-consed-per-request (round (- (getf after :consed) (getf before :consed))
                                                          served)))))))
      (stop-server process))))

(defun request-objects-bytes (&key (count 100000))
  "The bytes consed by the request and reply objects alone of a kept-alive
GET, made COUNT times as ours makes them for every request (its
constructors for PARALLEL-EASY-ACCEPTOR's classes), in this process: the
least a request served to Hunchentoot's handlers conses, since each must
get objects of its own -- a handler may keep *REQUEST* or *REPLY*, in a
closure, a session or a queue, and would see a reused one change."
  (let* ((acceptor (make-instance 'hrt:parallel-easy-acceptor :address "127.0.0.1" :port 0))
         (constructors (hrt::make-object-constructors acceptor))
         (plain-request (hrt::object-constructors-plain-request constructors))
         (headers (list (cons :host "127.0.0.1:8080"))))
    (flet ((make-objects ()
             (funcall plain-request acceptor "127.0.0.1" 8080 "127.0.0.1" 40000 headers nil
                      :get "/yo" :http/1.1 "/yo" nil '() '())
             (hrt::make-reply constructors t)))
      (make-objects)
      (let ((before (sb-ext:get-bytes-consed)))
        (dotimes (index count)
          (make-objects))
        (round (- (sb-ext:get-bytes-consed) before) count)))))

(defparameter *request-costs-seconds* 5
  "Seconds the costs of a kept-alive request are counted over: the readings
of the request count around them are each late by up to a request's turn
(a millisecond at 100 connections), which skews the calls per request by
a few ten-thousandths at 3 s.")

(defun append-request-costs (directory core)
  "Measure what a kept-alive request costs ours and add it to DIRECTORY's
summary.md and to the output."
  (let* ((costs (measure-request-costs core :seconds *request-costs-seconds*))
         (text (format nil "~%What a kept-alive request costs ours (0 ms handler, 100 connections, ~D s ~
                            while they are open, system calls counted by ~A): ~:[-~;~:*~,3F~] system ~
                            calls~@[ (~{~{~A ~,3F~}~^, ~})~] and ~:[-~;~:*~D~] bytes consed per request ~
                            (~D requests), of which ~D are the request and reply objects alone.~%"
                       *request-costs-seconds*
                       (case (getf costs :counted-by)
                         (:perf "the kernel's tracepoints, perf stat")
                         (:strace "strace -c -f, which slows every thread: perf could not count")
                         (t "nobody: neither perf nor strace could"))
                       (getf costs :system-calls-per-request)
                       (loop for (name . per-request) in (getf costs :calls)
                             collect (list name per-request))
                       (getf costs :bytes-consed-per-request)
                       (getf costs :requests)
                       (request-objects-bytes))))
    (with-open-file (out (concatenate 'string directory "summary.md") :direction :output :if-exists :append)
      (write-string text out))
    (write-string text)
    directory))
