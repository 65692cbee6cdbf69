;;;; `make test`: every test, then the compatibility suite in a process of
;;;; its own (test/run-compatibility.lisp; it says what it needs when the
;;;; libraries it loads are missing).  Ends with the line "N passed, M
;;;; failed" for both; exit 0 only when none failed.
;;;; SUITE in the environment names one suite instead (http, pool, processors, overload,
;;;; request-head, readiness, saturation, bodies, replies, listening, metrics,
;;;; garbage-input, extension-points, mixin-order, stop, slow-clients,
;;;; tls-handshakes, descriptor-limit, house, or compatibility alone).

(load (merge-pathnames "../tools/setup.lisp" *load-truename*))

(defun run-compatibility-suite ()
  "Run test/run-compatibility.lisp in a new SBCL, its output shown as it
comes: its checks passed and failed, or NIL and NIL when it could not run
for want of the libraries, and true when it failed in some other way."
  (uiop:with-temporary-file (:pathname counts-file)
    (let ((status (nth-value 2 (uiop:run-program
                                (list "sbcl" "--noinform" "--non-interactive" "--disable-debugger"
                                      "--load" (namestring (merge-pathnames "run-compatibility.lisp"
                                                                            *load-truename*)))
                                :output :interactive :error-output :interactive
                                :ignore-error-status t
                                :environment (cons (format nil "COUNTS_FILE=~A" (namestring counts-file))
                                                   (remove "COUNTS_FILE=" (sb-ext:posix-environ)
                                                           :test (lambda (prefix entry)
                                                                   (eql 0 (search prefix entry)))))))))
      (if (eql status 3)
          (values nil nil nil)
          (with-open-file (in counts-file :if-does-not-exist nil)
            (let ((passed (and in (read in nil nil)))
                  (failed (and in (read in nil nil))))
              (if (and (integerp passed) (integerp failed))
                  (values passed failed nil)
                  (values nil nil t))))))))

(let ((suite (or (uiop:getenv "SUITE") "ALL")))
  (if (string-equal suite "compatibility")
      (uiop:quit (multiple-value-bind (passed failed broken) (run-compatibility-suite)
                   (declare (ignore passed))
                   (if (or broken (null failed) (plusp failed)) 1 0))
                 nil)
      (progn
        (load-systems-quietly "hunchentoot-recycling-taskmaster/test")
        (multiple-value-bind (all-passed passed failed failure-lines)
            (uiop:symbol-call '#:hunchentoot-recycling-taskmaster-test '#:run-tests suite
                              (when (string-equal suite "ALL") "main"))
          (when (string-equal suite "ALL")
            (multiple-value-bind (compatibility-passed compatibility-failed broken) (run-compatibility-suite)
              (when broken
                (format t "~&compatibility: the suite ended without its counts~%"))
              (incf passed (or compatibility-passed 0))
              (incf failed (+ (or compatibility-failed 0) (if broken 1 0)))
              (setf all-passed (zerop failed))
              (when failure-lines
                (format t "~&Failed checks of the main run (each explained above):~%~{  ~A~%~}" failure-lines))
              (format t "~&~D passed, ~D failed~%" passed failed)))
          ;; The summary is printed and flushed, so exit at once instead of
          ;; through SBCL's exit protocol (unwind, stop the finalizer, join
          ;; every thread): once in CI that protocol hung after a passing run
          ;; until the job's time ran out.
          (finish-output)
          (finish-output *error-output*)
          (uiop:quit (if all-passed 0 1) nil)))))
