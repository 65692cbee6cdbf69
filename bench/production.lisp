;;;; The production configuration: ours as the demo runs (its access log to
;;;; a file, gzip at level 1, HTTP/2, TLS on a second port) against nginx
;;;; configured the same way (access_log to a file, gzip_comp_level 1,
;;;; http2, ssl with the same certificate and protocols), each load against
;;;; each in turn in every round: HTTP/1.1 kept alive, one request per
;;;; connection, h2c, HTTPS kept alive, a TLS handshake per request, h2 over
;;;; TLS, and a 10 KiB page gzipped.  `bench/run production [SECONDS
;;;; [ROUNDS]]`; make bench ends with it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *production-loads*
  '((:name "HTTP/1.1 kept alive" :client :wrk :path "/yo" :target 0.8)
    (:name "HTTP/1.1, one request per connection" :client :wrk :path "/yo" :close t :target 1.0)
    (:name "h2c" :client :h2load :path "/yo" :target 0.8)
    (:name "HTTPS kept alive" :client :wrk :tls t :path "/yo" :target 0.85)
    (:name "HTTPS, a TLS handshake per request" :client :wrk :tls t :path "/yo" :close t :target 0.9)
    (:name "h2 over TLS" :client :h2load :tls t :path "/yo" :target 0.85)
    (:name "a 10 KiB page, gzip" :client :wrk :path "/lorem" :gzip t :target 0.7))
  "Each load: its client, over TLS or not, kept alive or not, what it asks
for, and ours as a fraction of nginx it is to reach (issue 93).")

(defparameter *production-servers*
  '((:name "ours" :lisp :parallel
     :serve-options (:http2 t :compression '((:gzip 1))))
    (:name "nginx" :nginx-production t))
  "Ours as the demo is configured, and nginx; each logs to a file the run names.")

(defun nginx-production-config (directory port h1-port tls-port certificate key log-file)
  "nginx.conf for 2 workers as a deployed one: h2c on PORT, HTTP/1.1 on
H1-PORT (nginx 1.22 speaks one of them on a plain port), HTTP/1.1 and h2
over TLS on TLS-PORT with CERTIFICATE and KEY, its access log to LOG-FILE,
gzip at level 1; /yo and /lorem, the 10 KiB page in DIRECTORY."
  (format nil "~A  access_log ~A;
  gzip on; gzip_comp_level 1; gzip_min_length 256; gzip_vary on;
  server {
    listen 127.0.0.1:~D http2;
    listen 127.0.0.1:~D;
    listen 127.0.0.1:~D ssl http2;
    ssl_certificate ~A;
    ssl_certificate_key ~A;
    ssl_protocols TLSv1.2 TLSv1.3;
    location = /yo { default_type text/plain; return 200 \"Hey!\"; }
    location = /lorem { default_type text/html; alias ~Alorem.html; }
  }
}
" (nginx-config-opening directory) log-file port h1-port tls-port (namestring certificate) (namestring key)
          directory))

(defun launch-production-server (server port h1-port tls-port certificate key core log-file output-file)
  (if (getf server :nginx-production)
      (launch-nginx-with (lambda (directory)
                           (with-open-file (out (concatenate 'string directory "lorem.html") :direction :output)
                             (write-string *lorem-page* out))
                           (nginx-production-config directory port h1-port tls-port certificate key log-file))
                         output-file)
      (launch-server (list* :serve-options (list* :access-log log-file (getf server :serve-options)) server)
                     port 0 core output-file :ssl-port tls-port :ssl-certificate certificate :ssl-key key)))

(defun production-load (load port h1-port tls-port seconds)
  "LOAD for SECONDS against a server speaking h2c on PORT, HTTP/1.1 on
H1-PORT and TLS on TLS-PORT (h2load: as many requests as 60,000 a second
would make): a plist of :REQUESTS-PER-SECOND and :FAILED."
  (let* ((tls (getf load :tls))
         (target-port (cond (tls tls-port)
                            ((eq (getf load :client) :wrk) h1-port)
                            (t port)))
         (url (format nil "~:[http~;https~]://127.0.0.1:~D~A" tls target-port (getf load :path))))
    (ecase (getf load :client)
      (:wrk
       (let ((figures (parse-wrk (uiop:run-program
                                  (append (list "wrk" "-t2" "-c100" (format nil "-d~Ds" seconds) "--latency")
                                          (and (getf load :close) (list "-H" "Connection: close"))
                                          (and (getf load :gzip) (list "-H" "Accept-Encoding: gzip"))
                                          (list url))
                                  :output :string :error-output :output :ignore-error-status t))))
         (list :requests-per-second (getf figures :requests-per-second)
               :failed (let ((errors (https-cell-errors figures)))
                         (and (plusp errors) errors)))))
      (:h2load
       (let ((figures (h2load-figures (list :clients 100 :streams 10 :tls tls) target-port (* seconds 60000))))
         (list :requests-per-second (getf figures :requests-per-second)
               :failed (if (getf figures :requests-per-second)
                           (let ((failed (+ (or (getf figures :failed) 0) (or (getf figures :errored) 0))))
                             (and (plusp failed) failed))
                           (getf figures :failed))))))))

(defun gzipped-p (h1-port)
  "True when the server on H1-PORT sends /lorem gzipped to a client offering gzip."
  (equal "gzip" (coded-reply-octets h1-port "gzip")))

(defun measure-production-server (server seconds certificate key core work round)
  "Start SERVER as deployed, run every load of *PRODUCTION-LOADS* against it
(a second's warm-up each, then SECONDS), stop it: a list of (load . figures)."
  (let* ((port (free-port))
         (h1-port (if (getf server :nginx-production) (free-port) port))
         (tls-port (free-port))
         (log-file (format nil "~Aaccess-~A-round~D.log" work (getf server :name) round))
         (process (launch-production-server server port h1-port tls-port certificate key core log-file
                                            (format nil "~A~A-round~D.out" work (getf server :name) round))))
    (unwind-protect
         (if (and (wait-until-http2-serving port nil) (wait-until-serving h1-port)
                  (wait-until-serving tls-port :scheme "https") (gzipped-p h1-port))
             (loop for load in *production-loads*
                   collect (progn (production-load load port h1-port tls-port 1)
                                  (cons load (production-load load port h1-port tls-port seconds))))
             (loop for load in *production-loads*
                   collect (cons load (list :failed "server did not answer, or not gzipped, within 30 s"))))
      (stop-server process))))

(defun production-report (results rounds seconds)
  "The Markdown report of RESULTS, ((server . load) . figures) of every round."
  (flet ((median-of (server load)
           (median-cell (loop for ((s . l) . figures) in results
                              when (and (eq s server) (eq l load)) collect figures))))
    (destructuring-bind (ours nginx) *production-servers*
      (with-output-to-string (out)
        (format out "## The production configuration~%~%Ours as the demo runs (access log to a file, gzip 1, ~
                     HTTP/2, TLS) and nginx with 2 workers configured the same way (access_log to a file, ~
                     gzip_comp_level 1, http2, ssl; the same certificate, TLS 1.2 and 1.3), median of ~D rounds ~
                     of ~D s a load: wrk -t2 -c100, h2load -c100 -m10 -t2.~%~%~
                     | load | ours requests/s | nginx requests/s | ours / nginx | target | failed (ours, nginx) |~%~
                     |---|---:|---:|---:|---:|---:|~%" rounds seconds)
        (dolist (load *production-loads*)
          (let* ((ours-figures (median-of ours load))
                 (nginx-figures (median-of nginx load))
                 (ours-rate (getf ours-figures :requests-per-second))
                 (nginx-rate (getf nginx-figures :requests-per-second))
                 (ratio (and ours-rate nginx-rate (plusp nginx-rate) (/ ours-rate nginx-rate))))
            (format out "| ~A | ~:[-~;~:*~D~] | ~:[-~;~:*~D~] | ~A | ~,2F ~:[below~;ok~] | ~:[0~;~:*~A~], ~:[0~;~:*~A~] |~%"
                    (getf load :name) (and ours-rate (round ours-rate)) (and nginx-rate (round nginx-rate))
                    (if ratio (ratio-text ratio) "-") (getf load :target) (and ratio (>= ratio (getf load :target)))
                    (getf ours-figures :failed) (getf nginx-figures :failed))))))))

(defun run-production (&key core (rounds 3) (seconds 5) directory)
  "Measure *PRODUCTION-SERVERS* under *PRODUCTION-LOADS*, ROUNDS rounds,
ours then nginx in each, and write the report (WRITE-SUITE-REPORT,
production.md).  True when ours answered every load without a failure."
  (let* ((certificates (make-bench-certificate))
         (work (format nil "~A/" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (results (unwind-protect
                       (loop for round from 1 to rounds
                             append (loop for server in *production-servers*
                                          append (loop for (load . figures)
                                                         in (measure-production-server
                                                             server seconds (merge-pathnames "cert.pem" certificates)
                                                             (merge-pathnames "key.pem" certificates) core work round)
                                                       collect (cons (cons server load) figures))))
                    (dolist (folder (list work (namestring certificates)))
                      (uiop:delete-directory-tree (uiop:ensure-directory-pathname folder) :validate t
                                                                                          :if-does-not-exist :ignore)))))
    (write-suite-report (production-report results rounds seconds) "production" directory)
    (loop for ((server . nil) . figures) in results
          always (or (getf server :nginx-production) (null (getf figures :failed))))))
