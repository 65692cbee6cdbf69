;;;; The processors a process may use (src/sys/processors.lisp): the files
;;;; they are read from, and a pool made under taskset and under a cgroup's
;;;; quota, each in a child SBCL, sized to them and weighing growth by their
;;;; idle time, not the machine's.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite processors :in all :description "The processors a process may use, and the pool sized to them.")
(in-suite processors)

(defun stat-file-octets (text)
  "TEXT as the octets a file of it holds."
  (flex:string-to-octets text :external-format :latin-1))

(test processors.cgroup-files-parse
  (is (null (hrt::parse-cgroup-v2-quota (format nil "max 100000~%"))))
  (is (eql 3/2 (hrt::parse-cgroup-v2-quota (format nil "150000 100000~%"))))
  (is (eql 1/2 (hrt::cgroup-quota (format nil "50000~%") (format nil "100000~%"))))
  (is (null (hrt::cgroup-quota (format nil "-1~%") (format nil "100000~%"))))
  (is (null (hrt::cgroup-quota "garbage" "100000")))
  (is (equal '((("cpu" "cpuacct") . "/docker/abc") (nil . "/user.slice"))
             (hrt::parse-proc-self-cgroup (format nil "4:cpu,cpuacct:/docker/abc~%0::/user.slice~%"))))
  (let ((usage (stat-file-octets (format nil "usage_usec 123456~%user_usec 1~%"))))
    (is (eql 123456 (hrt::parse-cgroup-usage usage (length usage)))))
  (let ((usage (stat-file-octets (format nil "987654321~%"))))
    (is (eql 987654321 (hrt::parse-cgroup-usage usage (length usage))))))

(test processors.proc-stat-lines-of-some-processors
  (let ((stat (stat-file-octets (format nil "cpu  10 0 10 100 5 0 0 0 0 0~%cpu0 4 0 6 20 1 0 0 0 0 0~%~
                                       cpu1 6 0 4 80 4 0 0 0 0 0~%intr 1 2 3~%"))))
    (is (equal '(105 125) (multiple-value-list (hrt::parse-processor-ticks stat (length stat)))))
    (is (equal '(21 31) (multiple-value-list (hrt::parse-processor-ticks stat (length stat) '(0)))))
    (is (equal '(84 94) (multiple-value-list (hrt::parse-processor-ticks stat (length stat) '(1)))))
    (is (null (hrt::parse-processor-ticks stat (length stat) '(0 2))) "a processor without a line")))

(defparameter *processors-child-form*
  "(let* ((taskmaster (make-instance 'hunchentoot-recycling-taskmaster:recycling-taskmaster))
          (limit (hunchentoot-recycling-taskmaster::pool-processor-limit taskmaster))
          (gauge (hunchentoot-recycling-taskmaster::make-idle-gauge limit)))
     (flet ((share-while (busy)
              (hunchentoot-recycling-taskmaster::refresh-idle-gauge gauge 8)
              (let ((end (+ (get-internal-real-time) (floor internal-time-units-per-second 2))))
                (if busy
                    (loop while (< (get-internal-real-time) end))
                    (sleep 1/2)))
              (hunchentoot-recycling-taskmaster::refresh-idle-gauge gauge 8)
              (list (float (hunchentoot-recycling-taskmaster::idle-gauge-idle-share gauge) 1.0)
                    (hunchentoot-recycling-taskmaster::idle-gauge-growth-budget gauge))))
       (let ((*print-readably* nil))
         (format t \"~&RESULT ~S~%\"
                 (list :count (hunchentoot-recycling-taskmaster::processor-limit-count limit)
                       :quota (hunchentoot-recycling-taskmaster::processor-limit-quota limit)
                       :max-waiting (hunchentoot-recycling-taskmaster:taskmaster-max-waiting-thread-count taskmaster)
                       :busy (share-while t)
                       :idle (share-while nil))))))"
  "What a child SBCL prints of the pool it makes where it runs: the
processors it may use, its cgroup quota, its waiting workers, and the idle
share and growth budget (for a pool of 8 workers) while its main thread
spins for half a second, then while it sleeps.")

(defun processors-child-report (&rest command-prefix)
  "Run *PROCESSORS-CHILD-FORM* in a child SBCL started through
COMMAND-PREFIX (a program and its arguments that end by running the rest);
its report, a plist, or NIL."
  (let* ((output (uiop:run-program
                  (append command-prefix
                          (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
                                "--load" (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                                    "tools/setup.lisp"))
                                "--eval" "(load-systems-quietly \"hunchentoot-recycling-taskmaster\")"
                                "--eval" *processors-child-form*))
                  :output :string :error-output :output :ignore-error-status t))
         (start (search "RESULT " output)))
    (if start
        (read-from-string output t nil :start (+ start 7))
        (progn (format t "~&The child said:~%~A~%" output) nil))))

(test processors.taskset-one-processor-sizes-the-pool
  (let ((report (processors-child-report "taskset" "-c" "0")))
    (is (eql 1 (getf report :count)) "one processor to use: ~S" report)
    (is (eql 2 (getf report :max-waiting)) "two waiting workers, as on a machine of one processor")
    ;; Its one processor busy, the machine's others idle (2 on this one):
    ;; the machine's idle share would be half or more.
    (is (< (first (getf report :busy)) 15/100) "idle share while its processor spins: ~S" (getf report :busy))
    (is (eql 0 (second (getf report :busy))) "no growth while its processor is busy")
    (is (> (first (getf report :idle)) 1/2) "idle share while it sleeps: ~S" (getf report :idle))
    (is (plusp (second (getf report :idle))) "growth while its processor is idle")))

(defun writable-cgroup-v1-cpu-p ()
  "True when this process may make cgroups of v1's cpu and cpuacct controllers."
  (and (hrt::directory-path-p "/sys/fs/cgroup/cpu/")
       (hrt::directory-path-p "/sys/fs/cgroup/cpuacct/")
       (zerop (sb-posix:geteuid))))

(test processors.cgroup-quota-sizes-the-pool
  (if (not (writable-cgroup-v1-cpu-p))
      (skip "This machine lets no test make a cgroup v1 cpu controller group.")
      (let ((name (format nil "hrt-test-~D" (sb-posix:getpid))))
        (flet ((group (controller) (format nil "/sys/fs/cgroup/~A/~A/" controller name)))
          (unwind-protect
               (progn
                 (ensure-directories-exist (group "cpu"))
                 (ensure-directories-exist (group "cpuacct"))
                 (with-open-file (out (concatenate 'string (group "cpu") "cpu.cfs_quota_us")
                                      :direction :output :if-exists :append)
                   (format out "50000~%"))
                 (let ((report (processors-child-report
                                "sh" "-c" (format nil "echo $$ > ~Acgroup.procs && echo $$ > ~Acgroup.procs && exec \"$0\" \"$@\""
                                                  (group "cpu") (group "cpuacct")))))
                   (is (eql 1/2 (getf report :quota)) "half a processor's quota read: ~S" report)
                   (is (eql 1 (getf report :count)))
                   (is (eql 2 (getf report :max-waiting)))
                   ;; Spinning, it uses its whole quota while the machine's
                   ;; processors stay three-quarters idle.
                   (is (< (first (getf report :busy)) 15/100) "idle share of its quota while it spins: ~S"
                       (getf report :busy))
                   (is (eql 0 (second (getf report :busy))))
                   (is (> (first (getf report :idle)) 1/2) "idle share of its quota while it sleeps: ~S"
                       (getf report :idle))))
            (dolist (controller '("cpu" "cpuacct"))
              (when (hrt::directory-path-p (group controller))
                (sb-posix:rmdir (group controller)))))))))
