;;;; `make test`: run every test, exit 0 only when none failed.
;;;; SUITE in the environment names one suite (http, pool, overload,
;;;; request-head, readiness, saturation, bodies, replies, listening, metrics, garbage-input,
;;;; extension-points, stop, slow-clients, tls-handshakes, descriptor-limit).

(load (merge-pathnames "../tools/setup.lisp" *load-truename*))
(asdf:load-system "hunchentoot-recycling-taskmaster/test")
;;; The summary is printed and flushed, so exit at once instead of through
;;; SBCL's exit protocol (unwind, stop the finalizer, join every thread): once
;;; in CI that protocol hung after a passing run until the job's time ran out.
(let ((all-passed (uiop:symbol-call '#:hunchentoot-recycling-taskmaster-test '#:run-tests
                                    (or (uiop:getenv "SUITE") "ALL"))))
  (finish-output)
  (finish-output *error-output*)
  (uiop:quit (if all-passed 0 1) nil))
