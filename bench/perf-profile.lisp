;;;; Where ours spends its processor time in user mode, sampled by perf
;;;; record: the kernel's sampler, thousands of samples a second over every
;;;; thread, with nothing run in the threads it samples.  sb-sprof
;;;; (bench/profile.lisp) interrupts them with a signal and took 682 samples
;;;; in 8 s of eight workers at 1,000 connections; this takes some 8,000 in
;;;; 4 s.  perf cannot name Lisp functions: the server lists where its code
;;;; lies (GET /bench-code-map, CODE-MAP) and the samples are named here.
;;;; User mode only, as the kernel's part of a request (its system calls) is
;;;; counted by MEASURE-REQUEST-COSTS; the user and system time a request
;;;; are printed beside it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defun parse-code-map (text)
  "CODE-MAP's TEXT as a vector of (start end name), sorted by start."
  (sort (coerce (loop for line in (uiop:split-string text :separator '(#\Newline))
                      for length-start = (position #\Space line)
                      for name-start = (and length-start (position #\Space line :start (1+ length-start)))
                      when name-start
                        collect (let ((start (parse-integer line :end length-start :radix 16)))
                                  (list start
                                        (+ start (parse-integer line :start (1+ length-start) :end name-start
                                                                     :radix 16))
                                        (subseq line (1+ name-start)))))
                'vector)
        #'< :key #'first))

(defun code-range-name (ranges address)
  "The name of the range of RANGES (from PARSE-CODE-MAP) holding ADDRESS, or NIL."
  (let ((low 0) (high (length ranges)))
    ;; The last range starting at or below ADDRESS.
    (loop while (< low high)
          do (let ((middle (floor (+ low high) 2)))
               (if (<= (first (aref ranges middle)) address)
                   (setf low (1+ middle))
                   (setf high middle))))
    (when (plusp low)
      (destructuring-bind (start end name) (aref ranges (1- low))
        (and (<= start address) (< address end) name)))))

(defun file-mappings (pid file)
  "The mappings of FILE into process PID, from /proc/PID/maps, as lists
(file offset, end of that offset range, address): perf gives a sample in a
file-backed mapping -- the core's code -- as its offset in the file."
  (loop for line in (uiop:read-file-lines (format nil "/proc/~D/maps" pid))
        for fields = (remove "" (uiop:split-string line :separator " ") :test #'string=)
        when (and (= (length fields) 6) (string= (sixth fields) file))
          collect (destructuring-bind (start end) (mapcar (lambda (address) (parse-integer address :radix 16))
                                                          (uiop:split-string (first fields) :separator "-"))
                    (let ((offset (parse-integer (third fields) :radix 16)))
                      (list offset (+ offset (- end start)) start)))))

(defun sample-frame-name (ranges mappings address symbol)
  "The name of the function at ADDRESS in a sample: a Lisp function by
RANGES, at ADDRESS or at the address its file offset is mapped to
(MAPPINGS), else perf's SYMBOL (a C function), else the address."
  (or (code-range-name ranges address)
      (loop for (offset offset-end mapped) in mappings
            thereis (and (<= offset address) (< address offset-end)
                         (code-range-name ranges (+ mapped (- address offset)))))
      (and (string/= symbol "[unknown]") (plusp (length symbol)) symbol)
      (format nil "#x~X" address)))

(defun read-perf-samples (text ranges mappings)
  "perf script -F ip,sym's TEXT as a list of samples, each the list of its
frames' names, innermost first."
  (let ((samples '()) (frames '()))
    (flet ((end-sample ()
             (when frames
               (push (nreverse frames) samples)
               (setf frames '()))))
      (dolist (line (uiop:split-string text :separator '(#\Newline)))
        (let* ((line (string-trim '(#\Space #\Tab) line))
               (space (position #\Space line))
               (address (and (plusp (length line))
                             (parse-integer line :end space :radix 16 :junk-allowed t))))
          (if address
              (push (sample-frame-name ranges mappings address
                                       (if space (string-trim " " (subseq line space)) ""))
                    frames)
              (end-sample))))
      (end-sample))
    (nreverse samples)))

(defun short-name (name)
  "NAME with the packages of ours and Hunchentoot as their nicknames."
  (cl-ppcre:regex-replace-all "HUNCHENTOOT(?=:)"
                              (cl-ppcre:regex-replace-all "HUNCHENTOOT-RECYCLING-TASKMASTER(?=:)" name "HRT")
                              "HT"))

(defun counts-ranked (counts)
  "The entries of the hash table COUNTS (name -> count) as (name . count),
the highest count first."
  (sort (loop for name being the hash-keys of counts using (hash-value count)
              collect (cons name count))
        #'> :key #'cdr))

(defun print-perf-report (samples &key (top 40) (callers 12))
  "The TOP functions by samples in which they ran themselves, the 2 x TOP
by samples in which they ran or were on the stack (inclusive), and the
callers of the first CALLERS of the former."
  (let ((self (make-hash-table :test #'equal))
        (inclusive (make-hash-table :test #'equal))
        (total (length samples)))
    (dolist (sample samples)
      (incf (gethash (first sample) self 0))
      ;; A function counts once in a sample however often it recurs there.
      (dolist (name (remove-duplicates sample :test #'equal))
        (incf (gethash name inclusive 0))))
    (flet ((print-shares (ranked count-printed)
             (loop for (name . count) in ranked
                   repeat count-printed
                   do (format t "  ~5,2F% ~6D  ~A~%" (* 100 (/ count (max total 1))) count (short-name name)))))
      (let ((ranked (counts-ranked self)))
        (format t "~&~:D samples of user time.  Self:~%" total)
        (print-shares ranked top)
        (format t "~%Inclusive (the samples in which each ran or was on the stack):~%")
        (print-shares (counts-ranked inclusive) (* 2 top))
        (format t "~%Callers of the first ~D:~%" callers)
        (loop for (name) in ranked
              repeat callers
              do (let ((counts (make-hash-table :test #'equal)))
                   (dolist (sample samples)
                     (when (and (equal (first sample) name) (second sample))
                       (incf (gethash (second sample) counts 0))))
                   (format t "  ~A~%" (short-name name))
                   (loop for (caller . count) in (counts-ranked counts)
                         repeat 4
                         do (format t "    ~6D  ~A~%" count (short-name caller)))))))))

(defun request-times (pid port seconds)
  "Requests/s of ours (process PID, on PORT) over SECONDS, and the user and
system time a request in microseconds, all its threads."
  (multiple-value-bind (total user-before system-before) (process-cpu-seconds pid)
    (declare (ignore total))
    (let ((before (lisp-counters port)))
      (sleep seconds)
      (let ((served (max 1 (- (getf (lisp-counters port) :requests) (getf before :requests)))))
        (multiple-value-bind (total user-after system-after) (process-cpu-seconds pid)
          (declare (ignore total))
          (values (round served seconds)
                  (/ (* 1d6 (- user-after user-before)) served)
                  (/ (* 1d6 (- system-after system-before)) served)))))))

(defun run-perf-profile (&key core (connections 1000) (delay-ms 0) (seconds 4) session (top 40) (callers 12))
  "Ours from CORE in a process of its own, /yo kept alive over CONNECTIONS
connections with a handler of DELAY-MS (with SESSION, a returning user's
session counter /app/counter, per-core's session cell, instead): its
requests/s and processor time a request over 2 s (REQUEST-TIMES), then perf
record's samples of its user time over SECONDS, named (PRINT-PERF-REPORT)
-- the times are read before perf samples, as its interrupts would add to
them.  True when perf sampled."
  (let* ((port (free-port))
         (process (launch-server (second *servers*) port delay-ms core nil))
         (pid (uiop:process-info-pid process))
         (workload (list :delay-ms delay-ms :close nil :connections connections
                         :path (if session "/app/counter" "/yo")))
         (directory (format nil "~A/" (shell-line "mktemp -d")))
         (data (concatenate 'string directory "perf.data")))
    (unwind-protect
         (when (wait-until-serving port)
           (when session
             (setf workload (list* :cookie (returning-user-cookie port) workload)))
           (wrk port workload 2)
           (let ((ranges (parse-code-map (http-get port "/bench-code-map")))
                 (mappings (file-mappings pid (namestring (truename core))))
                 (load (uiop:launch-program (wrk-command port workload (+ seconds 4))
                                            :output nil :error-output nil)))
             ;; wrk's connections are open and busy a second in.
             (sleep 1)
             (multiple-value-bind (requests-per-second user system) (request-times pid port 2)
               (format t "~&Ours, ~A kept alive over ~D connections, ~D ms handler: ~:D requests/s;~%~
                          a request took ~,2F us of user time and ~,2F us of system time (all threads).~%"
                       (workload-path workload) connections delay-ms requests-per-second user system))
             (uiop:run-program (list "perf" "record" "-q" "-g" "-e" "cpu-clock:u" "-F" "4999"
                                     "-p" (princ-to-string pid) "-o" data
                                     "--" "sleep" (princ-to-string seconds))
                               :output nil :error-output nil :ignore-error-status t)
             (uiop:wait-process load)
             (let ((samples (read-perf-samples
                             (uiop:run-program (list "perf" "script" "-i" data "-F" "ip,sym")
                                               :output :string :error-output nil :ignore-error-status t)
                             ranges mappings)))
               (when samples
                 (print-perf-report samples :top top :callers callers)
                 t))))
      (stop-server process)
      (uiop:run-program (list "rm" "-rf" directory)))))
