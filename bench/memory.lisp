;;;; The memory budget's books under load: the demo as `make run` serves it
;;;; (compression, HTTP/2, SBCL's default 1 GiB heap) against replies of a
;;;; megabyte built by the handler as a 4 MB string (/lorem?kb=1000), each
;;;; load alone for SECONDS: over h2c, 10 connections of 100 streams with
;;;; their windows open, then never opened; over HTTP/1.1, 50 and 300
;;;; kept-alive clients asking it coded with br, gzip and not.  Then the soak:
;;;; all of them at once with event streams, publishes, websocket echoes and
;;;; slow readers, for SOAK-SECONDS, the budget's held octets and the heap
;;;; printed every 10 s.  Meanwhile GET /yo on a connection of its own every
;;;; 250 ms.  `bench/run memory [SECONDS [SOAK-SECONDS]]`; exit status 0
;;;; when every check passes: the process lives, the heap's peak stays under
;;;; 60 % of the dynamic space, the budget holds 0 octets after each load,
;;;; and after the soak the live heap is back within 10 % of where it began
;;;; within 30 s.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *heap-peak-share* 6/10
  "The share of the dynamic space the heap may reach under any load.")

(defun launch-demo (port log-file)
  "The demo of `make run` on PORT in an SBCL of its own, writing to
LOG-FILE; its process-info, once it answers /yo."
  (let ((process (uiop:launch-program
                  (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
                        "--load" "tools/setup.lisp"
                        "--eval" "(load-systems-quietly \"hunchentoot-recycling-taskmaster/demo\")"
                        "--eval" (format nil "(hunchentoot-recycling-taskmaster-demo:main :port ~D)" port))
                  :output log-file :error-output :output :if-output-exists :supersede)))
    (if (loop repeat 1200
              thereis (equal "Hey!" (http-get port "/yo"))
              do (sleep 0.1))
        process
        (progn (stop-server process) nil))))

(defun demo-stats (port &key gc reset-peak)
  "The demo's /stats as a plist of keywords and integers (those whose value
is one), or NIL when it does not answer."
  (let ((text (http-get port (format nil "/stats?gc=~:[0~;1~]&reset-peak=~:[0~;1~]" gc reset-peak))))
    (and text
         (loop for line in (uiop:split-string text :separator '(#\Newline))
               for colon = (position #\: line)
               for value = (and colon (parse-integer line :start (1+ colon) :junk-allowed t))
               when value
                 append (list (intern (string-upcase (subseq line 0 colon)) :keyword) value)))))

(defun demo-stats-within (port seconds &key gc)
  "The demo's /stats (DEMO-STATS) once it answers, asked again until SECONDS
have passed, or NIL: right after a load, the requests it left queued are
served first."
  (loop with deadline = (+ (get-internal-real-time) (* seconds internal-time-units-per-second))
        thereis (demo-stats port :gc gc)
        while (< (get-internal-real-time) deadline)
        do (sleep 0.5)))

(defun yo-milliseconds (port)
  "How long GET /yo took on a new connection, in milliseconds, or NIL when
it was not answered 200 within 5 s."
  (let ((output (uiop:run-program (list "curl" "-s" "-o" "/dev/null" "-m" "5" "-w" "%{http_code} %{time_total}"
                                        (format nil "http://127.0.0.1:~D/yo" port))
                                  :output :string :ignore-error-status t)))
    (and (eql 0 (search "200 " output))
         (round (* 1000 (let ((*read-default-float-format* 'double-float))
                          (read-from-string output t nil :start 4)))))))

(defun while-watching-yo (port function)
  "Call FUNCTION in a thread; meanwhile GET /yo every 250 ms.  FUNCTION's
value, and the milliseconds each /yo took (NIL for one not answered)."
  (let* ((result nil)
         (thread (bt:make-thread (lambda () (setf result (funcall function))) :name "memory load"))
         (times (loop while (bt:thread-alive-p thread)
                      collect (yo-milliseconds port)
                      do (sleep 0.25))))
    (bt:join-thread thread)
    (values result times)))

(defun held-back-to-zero-p (port)
  "True once the demo's budget holds 0 octets, within 10 s."
  (loop repeat 100
        thereis (eql 0 (getf (demo-stats port) :memory-held-bytes))
        do (sleep 0.1)))

(defun load-command (load port seconds)
  "The command line of LOAD, (KIND . OPTIONS), against PORT for SECONDS."
  (let ((url (format nil "http://127.0.0.1:~D/lorem?kb=1000" port)))
    (destructuring-bind (kind &key (clients 10) (streams 100) window coding) load
      (ecase kind
        (:h2c (append (list "h2load" "-c" (princ-to-string clients) "-m" (princ-to-string streams)
                            "-D" (princ-to-string seconds) "-t" "2")
                      (and window (list "-w" (princ-to-string window) "-W" (princ-to-string window)))
                      (list url)))
        (:http/1.1 (append (list "wrk" "-t2" "-c" (princ-to-string clients) "-d" (format nil "~Ds" seconds)
                                 "--timeout" "10s")
                           (and coding (list "-H" (format nil "Accept-Encoding: ~A" coding)))
                           (list url)))))))

(defparameter *memory-loads*
  '(("h2c, 10 connections x 100 streams, windows open" :h2c)
    ("h2c, 10 connections x 100 streams, windows never opened" :h2c :window 0)
    ("HTTP/1.1, 50 clients, br" :http/1.1 :clients 50 :coding "br")
    ("HTTP/1.1, 50 clients, gzip" :http/1.1 :clients 50 :coding "gzip")
    ("HTTP/1.1, 50 clients, identity" :http/1.1 :clients 50)
    ("HTTP/1.1, 300 clients, br" :http/1.1 :clients 300 :coding "br")
    ("HTTP/1.1, 300 clients, gzip" :http/1.1 :clients 300 :coding "gzip")
    ("HTTP/1.1, 300 clients, identity" :http/1.1 :clients 300))
  "Each load alone: a name, then its kind and options (LOAD-COMMAND).")

(defun run-memory-load (process port name load seconds)
  "Run LOAD, named NAME, against the demo PROCESS on PORT for SECONDS, /yo
watched: a plist of :NAME, :ALIVE (the process), :PEAK (the heap's,
octets), :HELD-AFTER (true when the budget held 0 within 10 s), :YO (the
milliseconds of each /yo), :OUTPUT (the load's last line of figures)."
  (demo-stats port :reset-peak t)
  (multiple-value-bind (output times)
      (while-watching-yo port (lambda ()
                                (uiop:run-program (cons "timeout" (cons (princ-to-string (+ seconds 30))
                                                                        (load-command load port seconds)))
                                                  :output :string :error-output :output :ignore-error-status t)))
    (let ((stats (demo-stats-within port 30)))
      (list :name name :alive (uiop:process-alive-p process) :peak (getf stats :heap-peak-bytes)
            :held-after (and stats (held-back-to-zero-p port)) :yo times
            :output (let ((line (find-if (lambda (line) (or (search "req/s" line) (search "Requests/sec" line)))
                                         (uiop:split-string output :separator '(#\Newline)))))
                      (string-trim " " (or line "")))))))

(defun soak-commands (port seconds)
  "The soak's loads at once against PORT for SECONDS: h2load, wrk with br,
the event-stream and websocket clients, slow readers of /lorem."
  (append (list (load-command '(:h2c :clients 5) port seconds)
                (load-command '(:http/1.1 :clients 50 :coding "br") port seconds)
                (list "/usr/bin/python3" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                                    "bench/soak-clients.py"))
                      (princ-to-string port) (princ-to-string seconds) "200" "20"))
          (loop repeat 20
                collect (list "curl" "-s" "-o" "/dev/null" "--limit-rate" "20k" "-m" (princ-to-string seconds)
                              (format nil "http://127.0.0.1:~D/lorem?kb=1000" port)))))

(defun settled-live-heap (port live-before)
  "The demo's /stats after a full collection, once its live heap is back
within 10 % of LIVE-BEFORE, or as it is 30 s on: what the soak's connections
and threads held goes back as they end and the pool shrinks."
  (loop with deadline = (+ (get-internal-real-time) (* 30 internal-time-units-per-second))
        for stats = (demo-stats-within port 30 :gc t)
        until (or (null stats) (null live-before)
                  (<= (getf stats :heap-bytes) (* 11/10 live-before))
                  (> (get-internal-real-time) deadline))
        do (sleep 2)
        finally (return stats)))

(defun run-soak (port seconds)
  "The soak: SOAK-COMMANDS for SECONDS, the budget's held octets and the heap
printed every 10 s.  A plist of :SAMPLES (seconds, held, heap), :CLIENTS
(soak-clients.py's line), :LIVE-BEFORE and :LIVE-AFTER (the heap after a
full collection), :HELD-AFTER and :ALIVE."
  (let* ((live-before (getf (demo-stats port :gc t) :heap-bytes))
         (clients-output (format nil "~A/soak-clients.json"
                                 (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (processes (loop for command in (soak-commands port seconds)
                          for index from 0
                          collect (uiop:launch-program (cons "timeout" (cons (princ-to-string (+ seconds 60)) command))
                                                       :output (if (= index 2) clients-output nil)
                                                       :error-output (if (= index 2) :output nil))))
         (start (get-internal-real-time))
         (samples (loop for elapsed = (floor (- (get-internal-real-time) start) internal-time-units-per-second)
                        while (< elapsed seconds)
                        collect (let ((stats (demo-stats port)))
                                  (format t "~&soak ~4D s: held ~,1F MB, heap ~,1F MB~%" elapsed
                                          (/ (or (getf stats :memory-held-bytes) 0) 1048576)
                                          (/ (or (getf stats :heap-bytes) 0) 1048576))
                                  (finish-output)
                                  (list elapsed (getf stats :memory-held-bytes) (getf stats :heap-bytes)))
                        do (sleep 10)))
         (clients (progn (mapc #'uiop:wait-process processes)
                         (string-trim '(#\Newline) (uiop:read-file-string clients-output))))
         (held-after (held-back-to-zero-p port))
         (stats (settled-live-heap port live-before)))
    (list :samples samples :clients clients :live-before live-before
          :live-after (getf stats :heap-bytes) :held-after held-after :alive (and stats t))))

(defun memory-report (dynamic-space results soak seconds soak-seconds)
  (with-output-to-string (out)
    (format out "## Memory: the demo under replies of 1 MB~%~%Each load alone for ~D s against the demo ~
                 (SBCL's ~D MB heap); GET /yo on a new connection every 250 ms meanwhile.~%~%~
                 | load | alive | heap peak | budget 0 after | /yo max | /yo p99 | /yo unanswered | load's figures |~%~
                 |---|---|---:|---|---:|---:|---:|---|~%"
            seconds (round dynamic-space 1048576))
    (dolist (result results)
      (let ((answered (remove nil (getf result :yo))))
        (format out "| ~A | ~:[no~;yes~] | ~:[-~;~:*~D%~] | ~:[no~;yes~] | ~:[-~;~:*~D ms~] | ~:[-~;~:*~D ms~] | ~D of ~D | ~A |~%"
                (getf result :name) (getf result :alive)
                (and (getf result :peak) (round (* 100 (getf result :peak)) dynamic-space))
                (getf result :held-after) (and answered (reduce #'max answered))
                (and answered (percentile (sort (copy-list answered) #'<) 99/100))
                (count nil (getf result :yo)) (length (getf result :yo)) (getf result :output))))
    (when soak
      (format out "~%The soak, ~D s, all at once (h2load of 5 connections, wrk of 50 br clients, 200 event ~
                   streams with a publish every 100 ms, 20 websocket echoes, 20 slow readers): the budget's ~
                   held octets and the heap every 10 s~%~%| s | held | heap |~%|---:|---:|---:|~%" soak-seconds)
      (loop for (elapsed held heap) in (getf soak :samples)
            do (format out "| ~D | ~:[-~;~:*~,1F MB~] | ~:[-~;~:*~,1F MB~] |~%" elapsed
                       (and held (/ held 1048576)) (and heap (/ heap 1048576))))
      (format out "~%Clients: ~A~%Live heap before ~,1F MB, after ~,1F MB; budget 0 after: ~:[no~;yes~]~%"
              (getf soak :clients) (/ (or (getf soak :live-before) 0) 1048576)
              (/ (or (getf soak :live-after) 0) 1048576) (getf soak :held-after)))))

(defun memory-checks-pass-p (dynamic-space results soak)
  "True when every load left the demo alive, under *HEAP-PEAK-SHARE*, its
budget back to 0, and the soak its live heap within 10 % of where it
began; each failure printed."
  (flet ((check (passed label)
           (unless passed (format t "~&memory: failed: ~A~%" label))
           passed))
    (every #'identity
           (append (loop for result in results
                         collect (check (and (getf result :alive)
                                             (getf result :peak) (< (getf result :peak) (* *heap-peak-share* dynamic-space))
                                             (getf result :held-after))
                                        (getf result :name)))
                   (and soak
                        (list (check (and (getf soak :alive) (getf soak :held-after)
                                          (getf soak :live-before) (getf soak :live-after)
                                          (<= (getf soak :live-after) (* 11/10 (getf soak :live-before))))
                                     "the soak")
                              (check (and (cl-ppcre:scan "\"events\": [1-9]" (getf soak :clients))
                                          (cl-ppcre:scan "\"echoes\": [1-9]" (getf soak :clients)))
                                     (format nil "the soak's event streams and websockets were served: ~A"
                                             (getf soak :clients)))))))))

(defun run-memory (&key (seconds 60) (soak-seconds 600) core)
  "Run *MEMORY-LOADS* for SECONDS each, then the soak for SOAK-SECONDS (none
when 0), against one demo; write the report.  True when every check passes."
  (declare (ignore core))
  (let* ((port (free-port))
         (log-file (format nil "~A/demo.log" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (process (launch-demo port log-file)))
    (if (null process)
        (progn (format t "~&memory: the demo did not start: ~A~%" log-file) nil)
        (unwind-protect
             (let* ((dynamic-space (getf (demo-stats port) :dynamic-space-bytes))
                    (results (loop for (name . load) in *memory-loads*
                                   collect (let ((result (run-memory-load process port name load seconds)))
                                             (format t "~&~A: alive ~A, heap peak ~A, budget 0 after ~A; ~A~%"
                                                     name (getf result :alive) (getf result :peak)
                                                     (getf result :held-after) (getf result :output))
                                             (finish-output)
                                             result)
                                   while (uiop:process-alive-p process)))
                    (soak (and (plusp soak-seconds) (uiop:process-alive-p process) (run-soak port soak-seconds))))
               (write-suite-report (memory-report dynamic-space results soak seconds soak-seconds) "memory" nil)
               (memory-checks-pass-p dynamic-space results soak))
          (stop-server process)))))
