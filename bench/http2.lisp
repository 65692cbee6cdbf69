;;;; HTTP/2: GET /yo with h2load, ours against nginx's http2 side by side in
;;;; each round: h2c (prior knowledge) and h2 (TLS, ALPN) at 100 connections
;;;; of 10 streams at once, h2c at 1,000 connections of one stream, and ours
;;;; over HTTP/1.1 (h2load --h1, one request at a time a connection) beside
;;;; them.  `bench/run http2 [REQUESTS [ROUNDS]]`; make bench ends with it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *http2-cells*
  ;; SERVE's keyword arguments are printed into a form: the list quoted.
  '((:name "ours, h2c" :lisp :parallel :serve-options (:http2 t) :clients 100 :streams 10)
    (:name "nginx, h2c" :nginx-http2 t :clients 100 :streams 10)
    (:name "ours, h2" :lisp :parallel :serve-options (:http2 t) :tls t :clients 100 :streams 10)
    (:name "nginx, h2" :nginx-http2 t :tls t :clients 100 :streams 10)
    (:name "ours, h2c, 1000 connections" :lisp :parallel :serve-options (:http2 t) :clients 1000 :streams 1)
    (:name "nginx, h2c, 1000 connections" :nginx-http2 t :clients 1000 :streams 1)
    (:name "ours, HTTP/1.1" :lisp :parallel :serve-options (:http2 t) :h1 t :clients 100 :streams 1))
  "Each cell: the server, how h2load speaks to it, and with how many
connections and streams at once on each; each nginx cell follows the cell
of ours it is the ratio's denominator of.")

(defparameter *http2-targets* '(("ours, h2c" . 0.6) ("ours, h2" . 0.5))
  "Ours as a fraction of nginx in the cell after it: at least this.")

(defun nginx-http2-config (directory port tls certificate key)
  "nginx.conf for 2 workers answering /yo over HTTP/2 on PORT: h2 with
CERTIFICATE and KEY when TLS, else h2c (prior knowledge)."
  (format nil "~A  server {
    listen 127.0.0.1:~D~:[~; ssl~] http2;
~:[~2*~;    ssl_certificate ~A;
    ssl_certificate_key ~A;
    ssl_protocols TLSv1.2 TLSv1.3;
~]    http2_max_concurrent_streams 100;
    location /yo { default_type text/plain; return 200 \"Hey!\"; }
  }
}
" (nginx-config-opening directory) port tls tls (namestring certificate) (namestring key)))

(defun launch-http2-server (cell port certificate key core log-file)
  "Start CELL's server answering /yo on PORT (over TLS when the cell says);
its process-info.  Ours also listens in plain HTTP on another port when
on TLS, as SERVE does."
  (cond ((getf cell :nginx-http2)
         (launch-nginx-with (lambda (directory) (nginx-http2-config directory port (getf cell :tls) certificate key))
                            log-file))
        ((getf cell :tls)
         (launch-server cell (free-port) 0 core log-file :ssl-port port :ssl-certificate certificate :ssl-key key))
        (t (launch-server cell port 0 core log-file))))

(defun wait-until-http2-serving (port tls)
  "True once GET /yo on PORT answers Hey! over HTTP/2 (h2c with prior
knowledge, or h2 over TLS when TLS): nginx's h2c port speaks nothing else."
  (loop repeat 300
        thereis (equal "Hey!" (uiop:run-program (list "curl" "-s" "-k" "--max-time" "5"
                                                      (if tls "--http2" "--http2-prior-knowledge")
                                                      (format nil "~:[http~;https~]://127.0.0.1:~D/yo" tls port))
                                                :output :string :ignore-error-status t))
        do (sleep 0.1)))

(defun h2load-figures (cell port requests)
  "h2load's figures for CELL's load of REQUESTS on PORT: a plist of
:REQUESTS-PER-SECOND, :SUCCEEDED, :FAILED and :ERRORED."
  (let* ((clients (getf cell :clients))
         (output (uiop:run-program (append (list "timeout" "300" "h2load" "-n" (princ-to-string requests)
                                                 "-c" (princ-to-string clients) "-m" (princ-to-string (getf cell :streams))
                                                 "-t" "2")
                                           (and (getf cell :h1) (list "--h1"))
                                           (list (format nil "~:[http~;https~]://127.0.0.1:~D/yo" (getf cell :tls) port)))
                                   :output :string :error-output :output :ignore-error-status t)))
    (flet ((number-after (pattern)
             (multiple-value-bind (match groups) (cl-ppcre:scan-to-strings pattern output)
               (and match (read-from-string (aref groups 0))))))
      (let ((rate (number-after "finished in [0-9.]+m?s, ([0-9.]+) req/s")))
        (when (plusp (or (number-after "(\\d+) failed") 0))
          ;; What went wrong, for the log of the run.
          (format t "~&~A: ~A~%" (getf cell :name) output))
        (if rate
            (list :requests-per-second rate
                  :succeeded (number-after "(\\d+) succeeded") :failed (number-after "(\\d+) failed")
                  :errored (number-after "(\\d+) errored"))
            (list :failed (format nil "h2load: ~A" (subseq output 0 (min 200 (length output))))))))))

(defun measure-http2-cell (cell requests certificate key core directory round)
  (let* ((port (free-port))
         (process (launch-http2-server cell port certificate key core
                                       (format nil "~Ahttp2-~D-round~D.log" directory
                                               (position cell *http2-cells*) round))))
    (unwind-protect
         (if (wait-until-http2-serving port (getf cell :tls))
             (progn (h2load-figures cell port (min requests 20000))
                    (h2load-figures cell port requests))
             (list :failed "server did not answer within 30 s"))
      (stop-server process))))

(defun http2-cell-errors (figures)
  (if (getf figures :requests-per-second)
      (+ (or (getf figures :failed) 0) (or (getf figures :errored) 0))
      1))

(defun http2-report (results rounds requests)
  "The Markdown report of RESULTS, (cell . figures) of every round."
  (flet ((median-of (cell) (median-cell (loop for (c . figures) in results when (eq c cell) collect figures))))
    (with-output-to-string (out)
      (format out "## HTTP/2~%~%GET /yo with h2load -n ~D -t 2, median of ~D rounds; nginx with 2 workers ~
                   and http2 on; ratio: ours to the nginx cell after it~%~%~
                   | server | connections | streams each | requests/s | ratio to nginx | failed |~%~
                   |---|---:|---:|---:|---:|---:|~%" requests rounds)
      (loop for (cell next) on *http2-cells*
            for figures = (median-of cell)
            for rate = (getf figures :requests-per-second)
            for nginx = (and next (getf next :nginx-http2) (getf (median-of next) :requests-per-second))
            do (format out "| ~A | ~D | ~D | ~:[-~;~:*~D~] | ~A | ~D~@[ (~A)~] |~%"
                       (getf cell :name) (getf cell :clients) (getf cell :streams) (and rate (round rate))
                       (if (and rate nginx (plusp nginx) (getf cell :lisp)) (ratio-text (/ rate nginx)) "-")
                       (http2-cell-errors figures) (and (stringp (getf figures :failed)) (getf figures :failed))))
      (loop for (name . target) in *http2-targets*
            for position = (position name *http2-cells* :key (lambda (cell) (getf cell :name)) :test #'string=)
            for ours = (getf (median-of (nth position *http2-cells*)) :requests-per-second)
            for nginx = (getf (median-of (nth (1+ position) *http2-cells*)) :requests-per-second)
            for ratio = (and ours nginx (plusp nginx) (/ ours nginx))
            do (format out "~%~A as a fraction of nginx: ~A (target ~,2F: ~A)~%" name
                       (if ratio (ratio-text ratio) "-") target (if (and ratio (>= ratio target)) "ok" "below"))))))

(defparameter *http2-integrity-loads*
  '(("100 POST streams of 1 MiB on one connection, each body's SHA-1 checked" "uploads" 100 1048576
     "right" 100)
    ("100 streams of 1 MiB, windows at their largest, read at full speed, 20 connections in turn" "downloads"
     100 1024 20 2147483647 "complete" 2000)
    ("60 streams of 1 MiB, windows of 64 KiB, 5 connections in turn" "downloads" 60 1024 5 65535
     "complete" 300))
  "Loads that check every octet (test/http2-client.py): a name, the
client's command and arguments, the count in its JSON line that is to be
the number after it.")

(defun http2-client-line (command port &rest arguments)
  "The JSON line test/http2-client.py prints for COMMAND against PORT."
  (uiop:run-program (list* "timeout" "600" "/usr/bin/python3"
                           (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                      "test/http2-client.py"))
                           command (princ-to-string port) (mapcar #'princ-to-string arguments))
                    :output :string :error-output :output :ignore-error-status t))

(defun run-http2-integrity (core)
  "Run *HTTP2-INTEGRITY-LOADS* against ours over h2c: a report section and
whether every count was as it is to be."
  (let* ((port (free-port))
         (process (launch-server '(:lisp :parallel :serve-options (:http2 t)) port 0 core "/dev/null"))
         (results (unwind-protect
                       (if (wait-until-http2-serving port nil)
                           (loop for (name command . rest) in *http2-integrity-loads*
                                 collect (let* ((arguments (butlast rest 2))
                                                (key (first (last rest 2)))
                                                (expected (first (last rest)))
                                                (line (string-trim '(#\Newline)
                                                                   (apply #'http2-client-line command port arguments)))
                                                (match (nth-value 1 (cl-ppcre:scan-to-strings
                                                                     (format nil "\"~A\": (\\d+)" key) line))))
                                           (list name line (and match (= expected (parse-integer (aref match 0)))))))
                           (list (list "the server" "did not answer within 30 s" nil)))
                    (stop-server process))))
    (values (with-output-to-string (out)
              (format out "~%Every octet, ours over h2c (test/http2-client.py):~%~%| load | result | all right |~%|---|---|---|~%")
              (loop for (name line passed) in results
                    do (format out "| ~A | `~A` | ~:[no~;yes~] |~%" name line passed)))
            (every #'third results))))

(defun run-http2 (&key core (rounds 3) (requests 200000) directory)
  "Measure *HTTP2-CELLS*, ROUNDS rounds of REQUESTS each in turn, and write
the report (WRITE-SUITE-REPORT, http2.md).  True when every cell of ours
answered every request."
  (let* ((certificates (make-bench-certificate))
         (work (format nil "~A/" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (results (unwind-protect
                       (loop for round from 1 to rounds
                             append (loop for cell in *http2-cells*
                                          collect (cons cell (measure-http2-cell cell requests
                                                                                 (merge-pathnames "cert.pem" certificates)
                                                                                 (merge-pathnames "key.pem" certificates)
                                                                                 core work round))))
                    (dolist (folder (list work (namestring certificates)))
                      (uiop:delete-directory-tree (uiop:ensure-directory-pathname folder) :validate t
                                                                                          :if-does-not-exist :ignore)))))
    (multiple-value-bind (integrity-report integrity-passed)
        (run-http2-integrity core)
      (write-suite-report (concatenate 'string (http2-report results rounds requests) integrity-report)
                          "http2" directory)
      (and integrity-passed
           (loop for (cell . figures) in results
                 always (or (not (getf cell :lisp)) (zerop (http2-cell-errors figures))))))))
