;;;; The access log's cost: GET /yo kept alive over HTTP/1.1 (wrk, 100
;;;; connections) and over h2c (h2load, 100 connections of 10 streams), ours
;;;; and nginx each with its access log off and to a file, side by side in
;;;; each round; ours also with Hunchentoot's own ACCEPTOR-LOG-ACCESS writing
;;;; the entries (what an application with a method of its own gets, and
;;;; what every acceptor got before the engine wrote them).  After each
;;;; cell the server is stopped and its file's lines counted against the
;;;; requests the client saw answered.  `bench/run access-log [SECONDS
;;;; [ROUNDS]]`; make bench ends with it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *access-log-cells*
  '((:name "ours" :lisp :parallel :serve-options (:http2 t))
    (:name "ours, log to a file" :lisp :parallel :serve-options (:http2 t) :log t)
    (:name "ours, log by Hunchentoot's method" :lisp :parallel :serve-options (:http2 t :hunchentoots-access-log t)
     :log t)
    (:name "nginx" :nginx-log t)
    (:name "nginx, log to a file" :nginx-log t :log t))
  "Each server and whether it logs to a file; each is measured over HTTP/1.1
and h2c.")

(defparameter *access-log-targets*
  '(("ours, log to a file" "ours" 0.9))
  "A cell's requests/s as a fraction of another's in the same load: at least this.")

(defun nginx-access-log-config (directory port h1-port log-file)
  "nginx.conf for 2 workers answering /yo over h2c (prior knowledge) on PORT
and HTTP/1.1 on H1-PORT (nginx 1.22 speaks one of them on a plain port),
with its access log to LOG-FILE when given."
  (format nil "~A  server {
    listen 127.0.0.1:~D http2;
    listen 127.0.0.1:~D;
    ~:[access_log off;~;~:*access_log ~A;~]
    location /yo { default_type text/plain; return 200 \"Hey!\"; }
  }
}
" (nginx-config-opening directory) port h1-port log-file))

(defun launch-access-log-server (cell port h1-port core log-file output-file)
  (if (getf cell :nginx-log)
      (launch-nginx-with (lambda (directory) (nginx-access-log-config directory port h1-port log-file)) output-file)
      (launch-server (if log-file
                         (list* :serve-options (list* :access-log log-file (getf cell :serve-options)) cell)
                         cell)
                     port 0 core output-file)))

(defun access-log-load (port h1-port protocol seconds)
  "Load a server for SECONDS over PROTOCOL (:HTTP/1.1 on H1-PORT, or :H2C
on PORT): a plist of :REQUESTS-PER-SECOND and :ANSWERED, or :FAILED."
  (ecase protocol
    (:http/1.1
     (let ((figures (parse-wrk (wrk h1-port (list :delay-ms 0 :connections 100) seconds))))
       (list :requests-per-second (getf figures :requests-per-second)
             :answered (getf figures :requests)
             :failed (let ((errors (+ (getf figures :read-errors) (getf figures :non-2xx 0))))
                       (and (plusp errors) errors)))))
    (:h2c
     ;; h2load counts requests, not seconds: as many as the HTTP/1.1 load
     ;; of ours answers in SECONDS, about.
     (let ((figures (h2load-figures '(:clients 100 :streams 10) port (* seconds 60000))))
       (list :requests-per-second (getf figures :requests-per-second)
             :answered (getf figures :succeeded)
             :failed (if (getf figures :requests-per-second)
                         (let ((failed (+ (or (getf figures :failed) 0) (or (getf figures :errored) 0))))
                           (and (plusp failed) failed))
                         (getf figures :failed)))))))

(defun file-line-count (file)
  (if (probe-file file)
      (with-open-file (in file) (loop for line = (read-line in nil) while line count t))
      0))

(defun measure-access-log-cell (cell protocol seconds core work round)
  "Warm CELL's server up with a load of a second, then measure it: the
load's figures, with the lines its log gained (the server stopped, so that
every line kept is written)."
  (let* ((port (free-port))
         (h1-port (if (getf cell :nginx-log) (free-port) port))
         (log-file (and (getf cell :log)
                        (format nil "~Aaccess-~D-~:[h1~;h2c~]-round~D.log" work (position cell *access-log-cells*)
                                (eq protocol :h2c) round)))
         (process (launch-access-log-server cell port h1-port core log-file
                                            (format nil "~Aserver-~D-round~D.out" work
                                                    (position cell *access-log-cells*) round))))
    (unwind-protect
         (if (and (wait-until-http2-serving port nil) (wait-until-serving h1-port))
             (let ((warm-lines (progn (access-log-load port h1-port protocol 1)
                                      ;; Ours writes what it keeps within 0.1 s.
                                      (sleep 0.5)
                                      (and log-file (file-line-count log-file))))
                   (figures (access-log-load port h1-port protocol seconds)))
               (stop-server (shiftf process nil))
               (append figures (and log-file (list :lines (- (file-line-count log-file) warm-lines)))))
             (list :failed "server did not answer within 30 s"))
      (when process
        (stop-server process)))))

(defun access-log-report (results rounds seconds)
  "The Markdown report of RESULTS, ((cell . protocol) . figures) of every round."
  (flet ((median-of (cell protocol)
           (median-cell (loop for ((c . p) . figures) in results
                              when (and (eq c cell) (eq p protocol)) collect figures)))
         (cell-named (name) (find name *access-log-cells* :key (lambda (cell) (getf cell :name)) :test #'string=)))
    (with-output-to-string (out)
      (format out "## The access log~%~%GET /yo kept alive, median of ~D rounds: HTTP/1.1 with wrk -t2 -c100 for ~D s, ~
                   h2c with h2load -c100 -m10 -t2 (~:D requests); nginx with 2 workers, its access_log ~
                   (format combined, no buffer) to a file or off; ours with Hunchentoot's format.  Lines: the ~
                   file's lines after the server stopped, against the requests the client counted answered ~
                   (it counts none it was still waiting for when the load ended).~%~%~
                   | protocol | server | requests/s | rounds | of itself without a log | lines / answered | failed |~%~
                   |---|---|---:|---|---:|---:|---:|~%" rounds seconds (* seconds 60000))
      (dolist (protocol '(:http/1.1 :h2c))
        (dolist (cell *access-log-cells*)
          (let* ((figures (median-of cell protocol))
                 (rate (getf figures :requests-per-second))
                 (bare (getf (median-of (cell-named (if (getf cell :nginx-log) "nginx" "ours")) protocol)
                             :requests-per-second)))
            (format out "| ~A | ~A | ~:[-~;~:*~D~] | ~{~D~^, ~} | ~A | ~:[-~;~:*~A~] | ~:[0~;~:*~A~] |~%"
                    (if (eq protocol :h2c) "h2c" "HTTP/1.1") (getf cell :name) (and rate (round rate))
                    (mapcar #'round (getf figures :rounds))
                    (if (and rate bare (plusp bare) (getf cell :log)) (ratio-text (/ rate bare)) "-")
                    (and (getf cell :log) (getf figures :lines)
                         (format nil "~:D / ~:D" (getf figures :lines) (getf figures :answered)))
                    (getf figures :failed)))))
      (dolist (protocol '(:http/1.1 :h2c))
        (loop for (name base target) in *access-log-targets*
              for rate = (getf (median-of (cell-named name) protocol) :requests-per-second)
              for base-rate = (getf (median-of (cell-named base) protocol) :requests-per-second)
              for ratio = (and rate base-rate (plusp base-rate) (/ rate base-rate))
              do (format out "~%~A, ~A as a fraction of ~A: ~A (target ~,2F: ~A)~%"
                         (if (eq protocol :h2c) "h2c" "HTTP/1.1") name base (if ratio (ratio-text ratio) "-")
                         target (if (and ratio (>= ratio target)) "ok" "below"))))
      (let ((ours (getf (median-of (cell-named "ours, log to a file") :http/1.1) :requests-per-second))
            (nginx (getf (median-of (cell-named "nginx, log to a file") :http/1.1) :requests-per-second)))
        (format out "~%HTTP/1.1, ours with its log to a file as a fraction of nginx with its: ~A~%"
                (if (and ours nginx (plusp nginx)) (ratio-text (/ ours nginx)) "-"))))))

(defun every-line-logged-p (results)
  "True when each cell that logs wrote a line for every request its client
counted answered, and no cell of ours failed."
  (loop for ((cell . nil) . figures) in results
        always (and (or (getf cell :nginx-log) (null (getf figures :failed)))
                    (or (not (getf cell :log)) (getf figures :failed)
                        (>= (or (getf figures :lines) 0) (or (getf figures :answered) 1))))))

(defun run-access-log (&key core (rounds 3) (seconds 5) directory)
  "Measure *ACCESS-LOG-CELLS* over HTTP/1.1 and h2c, ROUNDS rounds of
SECONDS each in turn, and write the report (WRITE-SUITE-REPORT,
access-log.md).  True when every log held a line for each request answered
and every cell of ours answered all."
  (let* ((work (format nil "~A/" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (results (unwind-protect
                       (loop for round from 1 to rounds
                             append (loop for protocol in '(:http/1.1 :h2c)
                                          append (loop for cell in *access-log-cells*
                                                       collect (cons (cons cell protocol)
                                                                     (measure-access-log-cell cell protocol seconds
                                                                                              core work round)))))
                    (uiop:delete-directory-tree (uiop:ensure-directory-pathname work) :validate t
                                                                                     :if-does-not-exist :ignore))))
    (write-suite-report (access-log-report results rounds seconds) "access-log" directory)
    (every-line-logged-p results)))
