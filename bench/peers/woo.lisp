;;;; Woo as a benchmark peer (bench/driver.lisp's *PEERS*): loaded from
;;;; ../shared/vendor into an SBCL of its own, its core saved once per run,
;;;; and served with 2 workers, as Woo's own benchmark runs it (1 in the
;;;; per-core table).  GET /yo
;;;; answers 200 text/plain "Hey!", after sleeping DELAY-MS when it is not 0;
;;;; GET /app/page the application cells' HTML page, when given its file.

(defpackage #:bench-peer
  (:use #:cl)
  (:export #:serve))

(in-package #:bench-peer)

(defun serve (port delay-ms &key page-file (workers 2))
  "Serve GET /yo on 127.0.0.1:PORT with WORKERS workers until killed; with PAGE-FILE, GET
/app/page answers that file's text as text/html, read once here, as the
application cells' page handler answers its page."
  (let ((delay (and (plusp delay-ms) (/ delay-ms 1000)))
        (page (and page-file (uiop:read-file-string page-file))))
    (woo:run (lambda (environment)
               (when delay
                 (sleep delay))
               (if (and page (equal (getf environment :path-info) "/app/page"))
                   `(200 (:content-type "text/html") (,page))
                   '(200 (:content-type "text/plain") ("Hey!"))))
             :port port :address "127.0.0.1" :worker-num workers :debug nil)))
