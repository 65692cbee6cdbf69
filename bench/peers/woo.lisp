;;;; Woo as a benchmark peer (bench/driver.lisp's *PEERS*): loaded from
;;;; ../shared/vendor into an SBCL of its own, its core saved once per run,
;;;; and served with 2 workers, as Woo's own benchmark runs it.  GET /yo
;;;; answers 200 text/plain "Hey!", after sleeping DELAY-MS when it is not 0.

(defpackage #:bench-peer
  (:use #:cl)
  (:export #:serve))

(in-package #:bench-peer)

(defun serve (port delay-ms)
  "Serve GET /yo on 127.0.0.1:PORT until killed."
  (let ((delay (and (plusp delay-ms) (/ delay-ms 1000))))
    (woo:run (lambda (environment)
               (declare (ignore environment))
               (when delay
                 (sleep delay))
               '(200 (:content-type "text/plain") ("Hey!")))
             :port port :address "127.0.0.1" :worker-num 2 :debug nil)))
