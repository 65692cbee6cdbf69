;;;; `make test`: run every test, exit 0 only when none failed.
;;;; SUITE in the environment names one suite (http, pool, overload).

(load (merge-pathnames "../tools/setup.lisp" *load-truename*))
(asdf:load-system "hunchentoot-recycling-taskmaster/test")
(uiop:quit (if (uiop:symbol-call '#:hunchentoot-recycling-taskmaster-test '#:run-tests
                                 (or (uiop:getenv "SUITE") "ALL"))
               0 1))
