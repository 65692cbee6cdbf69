;;;; HTTPS: GET /yo over TLS, kept alive and on a new TLS connection per
;;;; request (a TLS handshake each, as wrk makes them), for ours,
;;;; ours with three more certificates chosen by host name (SNI; wrk names
;;;; 127.0.0.1, one of them), Hunchentoot's SSL acceptor and nginx, side by
;;;; side in each round, as a ratio to nginx.  `bench/run https [SECONDS
;;;; [ROUNDS]]`.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *https-servers*
  '((:name "hunchentoot" :label "Hunchentoot easy-ssl-acceptor" :lisp :hunchentoot)
    (:name "parallel" :label "parallel-easy-ssl-acceptor" :lisp :parallel)
    (:name "parallel-sni" :label "parallel-easy-ssl-acceptor, 3 SNI certificates" :lisp :parallel :sni t)
    (:name "nginx" :label "nginx, 2 workers" :nginx t))
  "The servers of the HTTPS load, nginx last: every ratio is to it.")

(defparameter *https-workloads*
  '((:delay-ms 0 :close nil :connections 100)
    (:delay-ms 0 :close t :connections 100))
  "Kept alive, and one request per TLS connection.")

(defun nginx-https-config (directory port certificate key)
  "nginx.conf for 2 workers answering /yo over TLS on PORT with CERTIFICATE
and KEY, its files in DIRECTORY.  TLS 1.3 as well as 1.2, as nginx offers
from 1.23.4 (bookworm's 1.22 offers 1.2 at most by default) and as ours
does: the same handshake for both; session tickets on, nginx's default."
  (format nil "~A  server {
    listen 127.0.0.1:~D ssl;
    ssl_certificate ~A;
    ssl_certificate_key ~A;
    ssl_protocols TLSv1.2 TLSv1.3;
    location /yo { default_type text/plain; return 200 \"Hey!\"; }
  }
}
" (nginx-config-opening directory) port (namestring certificate) (namestring key)))

(defun sni-certificates (directory)
  "Three certificates by host name, made in DIRECTORY: for 127.0.0.1 (the
name wrk gives), *.example.org and example.net.  The :SSL-CERTIFICATES
that name them."
  (loop for (file name) in '(("loopback" "127.0.0.1") ("wildcard" "*.example.org") ("other" "example.net"))
        for certificate = (format nil "~A~A.pem" directory file)
        for key = (format nil "~A~A.key" directory file)
        do (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes" "-keyout" key
                                   "-out" certificate "-days" "2" "-subj" (format nil "/CN=~A" name))
                             :output nil :error-output nil)
        collect (list :names name :certificate-file certificate :privatekey-file key)))

(defun launch-https-server (server port certificate key core log-file sni-certificates)
  "Start SERVER answering /yo over TLS on PORT; its process-info.  A Lisp
server also listens in plain HTTP on another port, as SERVE does; one
marked :SNI serves SNI-CERTIFICATES too."
  (if (getf server :nginx)
      (launch-nginx-with (lambda (directory) (nginx-https-config directory port certificate key)) log-file)
      (launch-server server (free-port) 0 core log-file
                     :ssl-port port :ssl-certificate certificate :ssl-key key
                     :ssl-certificates (and (getf server :sni) sni-certificates))))

(defun measure-https-cell (server workload seconds certificate key core directory round sni-certificates)
  "Start SERVER, warm it, measure WORKLOAD over TLS for SECONDS, stop it.  A plist."
  (let* ((port (free-port))
         (base (format nil "~A~A_https_~A_round~D" directory (getf server :name)
                       (workload-file-name workload) round))
         (process (launch-https-server server port certificate key core
                                       (concatenate 'string base ".server.log") sni-certificates)))
    (unwind-protect
         (if (wait-until-serving port :scheme "https")
             (progn (wrk port workload 1 :scheme "https")
                    (parse-wrk (wrk port workload seconds :scheme "https")))
             (list :failed "server did not answer GET /yo over TLS within 30 s"))
      (stop-server process))))

(defun print-sni-fractions (rounds-of)
  "Print ours with SNI certificates as a fraction of ours with one, for
each workload: of the medians, and round by round.  ROUNDS-OF gives a
server's cells of a workload, in round order."
  (let ((one (find "parallel" *https-servers* :key (lambda (server) (getf server :name)) :test #'string=))
        (sni (find-if (lambda (server) (getf server :sni)) *https-servers*)))
    (format t "~%Ours with 3 SNI certificates as a fraction of ours with one (target: at least 0.95 ~
               for new connections):~%")
    (dolist (workload *https-workloads*)
      (flet ((rate (cell) (getf cell :requests-per-second)))
        (let ((one-rate (rate (median-cell (funcall rounds-of one workload))))
              (sni-rate (rate (median-cell (funcall rounds-of sni workload)))))
          (format t "- ~:[keep-alive~;new connection each~]: ~A (rounds:~{ ~A~})~%"
                  (getf workload :close)
                  (if (and one-rate sni-rate (plusp one-rate)) (ratio-text (/ sni-rate one-rate)) "-")
                  (loop for one-cell in (funcall rounds-of one workload)
                        for sni-cell in (funcall rounds-of sni workload)
                        collect (if (and (rate one-cell) (rate sni-cell) (plusp (rate one-cell)))
                                    (ratio-text (/ (rate sni-cell) (rate one-cell)))
                                    "-"))))))))

(defun https-cell-errors (cell)
  (+ (getf cell :connect-errors 0) (getf cell :read-errors 0) (getf cell :write-errors 0)
     (getf cell :timeout-errors 0) (getf cell :non-2xx 0)))

(defun run-https (&key (seconds 5) (rounds 5) core)
  "Print requests/s over TLS of every server of *HTTPS-SERVERS* on each of
*HTTPS-WORKLOADS*, ROUNDS rounds side by side, the median of each and its
ratio to nginx.  True when ours answered every request of every round
without an error."
  (let ((certificate-directory (make-bench-certificate))
        (directory (format nil "~A/" (string-right-trim '(#\Newline)
                                                        (uiop:run-program '("mktemp" "-d") :output :string)))))
    (unwind-protect
         (let* ((certificate (merge-pathnames "cert.pem" certificate-directory))
                (key (merge-pathnames "key.pem" certificate-directory))
                (sni-certificates (sni-certificates (namestring certificate-directory)))
                (cells (loop for round from 1 to rounds
                             append (loop for workload in *https-workloads*
                                          append (loop for server in *https-servers*
                                                       collect (list server workload
                                                                     (measure-https-cell server workload seconds certificate
                                                                                         key core directory round
                                                                                         sni-certificates)))))))
           (flet ((rounds-of (server workload)
                    (loop for (cell-server cell-workload cell) in cells
                          when (and (eq cell-server server) (eq cell-workload workload))
                            collect cell)))
             (format t "~&GET /yo over TLS (RSA 2048, ~A), wrk -t2 -c100, ~D s a round, median of ~D rounds; ~
                        one request per connection is a TLS handshake each, as wrk makes it (the same ~
                        client for every server)~%~%~
                        | workload | server | requests/s | ratio to nginx | p50 ms | p99 ms | errors and non-2xx | rounds |~%~
                        |---|---|---:|---:|---:|---:|---:|---|~%"
                     (string-trim '(#\Newline) (uiop:run-program '("openssl" "version") :output :string))
                     seconds rounds)
             (let ((clean t))
               (dolist (workload *https-workloads*)
                 (let ((nginx-rate (getf (median-cell (rounds-of (car (last *https-servers*)) workload))
                                         :requests-per-second)))
                   (dolist (server *https-servers*)
                     (let* ((measured (rounds-of server workload))
                            (cell (median-cell measured))
                            (rate (getf cell :requests-per-second))
                            (errors (reduce #'+ measured :key #'https-cell-errors))
                            (failures (remove nil (mapcar (lambda (cell) (getf cell :failed)) measured))))
                       (when (and (eq (getf server :lisp) :parallel) (or failures (plusp errors)))
                         (setf clean nil))
                       (format t "| ~:[keep-alive~;new connection each~] | ~A | ~:[-~;~:*~D~] | ~A | ~:[-~;~:*~,2F~] | ~:[-~;~:*~,2F~] | ~D~@[ (~{~A~^; ~})~] | ~{~D~^ ~} |~%"
                               (getf workload :close) (getf server :label) (and rate (round rate))
                               (if (and rate nginx-rate (plusp nginx-rate)) (ratio-text (/ rate nginx-rate)) "-")
                               (getf cell :p50-ms) (getf cell :p99-ms)
                               errors failures (mapcar #'round (getf cell :rounds)))))))
               (print-sni-fractions #'rounds-of)
               clean)))
      (uiop:delete-directory-tree certificate-directory :validate t)
      (uiop:delete-directory-tree (uiop:ensure-directory-pathname directory) :validate t))))
