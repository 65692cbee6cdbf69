;;;; An SSL acceptor's certificates: chosen by the name a ClientHello gives
;;;; (SNI), loaded again when their files are replaced while connections
;;;; already open keep going, a broken replacement logged once and the last
;;;; good certificate kept; ALPN.  The client is openssl s_client, as an
;;;; operator would check a server.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite tls-certificates :in all
  :description "Certificates by host name, renewed without a restart; ALPN.")
(in-suite tls-certificates)

(defun make-test-certificate (directory name common-name)
  "DIRECTORY's files NAME.pem and NAME.key: a new self-signed certificate
for COMMON-NAME and its key.  Their paths."
  (let ((certificate (concatenate 'string directory name ".pem"))
        (key (concatenate 'string directory name ".key")))
    (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes" "-keyout" key
                            "-out" certificate "-days" "2" "-subj" (format nil "/CN=~A" common-name))
                      :output nil :error-output nil)
    (values certificate key)))

(defun replace-file (from to)
  "Rename FROM over TO, in one rename(2), as a renewal tool does."
  (sb-posix:rename from to))

(defmacro with-scratch-folder ((var) &body body)
  `(let ((,var (make-scratch-folder)))
     (unwind-protect (progn ,@body)
       (uiop:delete-directory-tree (uiop:ensure-directory-pathname ,var) :validate t))))

(defun s-client (server &rest arguments)
  "What openssl s_client prints connecting to SERVER (an acceptor or a
port) with ARGUMENTS, its standard input empty: the handshake, then its
end."
  (uiop:run-program (list* "timeout" "10" "openssl" "s_client" "-connect"
                           (format nil "127.0.0.1:~D" (if (integerp server) server (ht:acceptor-port server)))
                           arguments)
                    :input "" :output :string :error-output :output :ignore-error-status t))

(defun served-name (server &rest arguments)
  "The common name of the certificate SERVER shows s_client with ARGUMENTS,
or NIL when the handshake failed."
  (multiple-value-bind (match groups)
      (cl-ppcre:scan-to-strings "(?m)^subject=CN ?= ?(\\S+)" (apply #'s-client server arguments))
    (and match (aref groups 0))))

(defun sni-server (directory &rest initargs)
  "An SSL acceptor whose own certificate is default.test's, and whose
:SSL-CERTIFICATES are exact.test's (also www.exact.test) and
*.wild.test's, all made in DIRECTORY."
  (multiple-value-bind (certificate key) (make-test-certificate directory "default" "default.test")
    (multiple-value-bind (exact exact-key) (make-test-certificate directory "exact" "exact.test")
      (multiple-value-bind (wild wild-key) (make-test-certificate directory "wild" "wild.test")
        (apply #'make-server 'parallel-easy-ssl-acceptor
               :ssl-certificate-file certificate :ssl-privatekey-file key
               :ssl-certificates `((:names ("exact.test" "www.exact.test")
                                    :certificate-file ,exact :privatekey-file ,exact-key)
                                   (:names "*.wild.test" :certificate-file ,wild :privatekey-file ,wild-key))
               initargs)))))

(test sni.exact-wildcard-and-default
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (with-server (server (sni-server directory))
        (loop for (name expected) in '(("exact.test" "exact.test")
                                       ("WWW.Exact.Test" "exact.test")
                                       ("a.wild.test" "wild.test")
                                       ("a.b.wild.test" "wild.test")
                                       ("wild.test" "default.test")
                                       ("unknown.test" "default.test")
                                       ("exact.test.evil" "default.test"))
              do (is (equal expected (served-name server "-servername" name))
                     "~A gets ~A's certificate" name expected))
        (is (equal "default.test" (served-name server "-noservername"))
            "a client naming no host gets the acceptor's own certificate")
        (is (= 3 (stats server :tls-certificates)))
        (multiple-value-bind (stream socket) (tls-connect server)
          (unwind-protect
               (progn (write-sequence (flex:string-to-octets (get-request "/test/yo")) stream)
                      (finish-output stream)
                      (is (eql 200 (read-stream-response stream))))
            (ignore-errors (close stream))
            (usocket:socket-close socket)))))))

(test sni.configuration-refused-at-make-instance
  (with-scratch-folder (directory)
    (multiple-value-bind (certificate key) (make-test-certificate directory "a" "a.test")
      (dolist (entries `(((:names () :certificate-file ,certificate :privatekey-file ,key))
                         ((:names "bad name" :certificate-file ,certificate :privatekey-file ,key))
                         ((:names "*." :certificate-file ,certificate :privatekey-file ,key))
                         ((:names "a.test" :privatekey-file ,key))
                         ((:names "a.test" :certificate-file ,certificate :privatekey-file ,key :password "x"))
                         ((:names "a.test" :certificate-file ,certificate :privatekey-file ,key)
                          (:names ("b.test" "A.test") :certificate-file ,certificate :privatekey-file ,key))
                         (:names "a.test")))
        (signals invalid-acceptor-configuration
          (make-server 'parallel-easy-ssl-acceptor :ssl-certificate-file certificate :ssl-privatekey-file key
                                                   :ssl-certificates entries))))))

(test sni.certificate-that-does-not-load-fails-start
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (multiple-value-bind (certificate key) (make-test-certificate directory "a" "a.test")
        (multiple-value-bind (other other-key) (make-test-certificate directory "b" "b.test")
          (declare (ignore other-key))
          (let ((server (make-server 'parallel-easy-ssl-acceptor
                                     :ssl-certificate-file certificate :ssl-privatekey-file key
                                     :ssl-certificates `((:names "b.test" :certificate-file ,other
                                                          :privatekey-file ,key)))))
            (handler-case (progn (ht:start server)
                                 (ht:stop server)
                                 (fail "a key not the certificate's was loaded"))
              (certificate-not-loaded (condition)
                (is (search "b.pem" (princ-to-string condition)))
                (is (search "key values mismatch" (certificate-refusal-reason condition))
                    "OpenSSL's reason: ~A" (certificate-refusal-reason condition))))))))))

(defun https-keep-alive-check (server)
  "A kept-alive TLS connection to SERVER answered once: a function that asks
it again and returns the status, and one that closes it."
  (multiple-value-bind (stream socket) (tls-connect server)
    (flet ((ask ()
             (write-sequence (flex:string-to-octets (get-request "/test/yo")) stream)
             (finish-output stream)
             (read-stream-response stream)))
      (is (eql 200 (ask)))
      (values #'ask (lambda () (ignore-errors (close stream)) (usocket:socket-close socket))))))

(test renewal.renamed-certificate-served-within-5-seconds
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (multiple-value-bind (certificate key) (make-test-certificate directory "live" "first.test")
        (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                          :ssl-certificate-file certificate :ssl-privatekey-file key))
          (is (equal "first.test" (served-name server)))
          (multiple-value-bind (ask close) (https-keep-alive-check server)
            (unwind-protect
                 (multiple-value-bind (next next-key) (make-test-certificate directory "next" "second.test")
                   (replace-file next-key key)
                   (replace-file next certificate)
                   (let ((start (get-internal-real-time)))
                     (is (wait-until (lambda () (equal "second.test" (served-name server))) :timeout 5)
                         "the renewed certificate is served within 5 s")
                     (is (< (- (get-internal-real-time) start) (* 5 internal-time-units-per-second))))
                   (is (eql 200 (funcall ask)) "a connection opened before the renewal still answers")
                   (is (= 1 (stats server :tls-certificate-reloads)))
                   (is (= 0 (stats server :tls-certificate-reload-failures))))
              (funcall close))))))))

(test renewal.symbolic-link-switched-as-certbot-does
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (multiple-value-bind (first first-key) (make-test-certificate directory "cert1" "first.test")
        (multiple-value-bind (second second-key) (make-test-certificate directory "cert2" "second.test")
          (let ((live (concatenate 'string directory "fullchain.pem"))
                (live-key (concatenate 'string directory "privkey.pem")))
            (sb-posix:symlink first live)
            (sb-posix:symlink first-key live-key)
            (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                              :ssl-certificate-file live :ssl-privatekey-file live-key))
              (is (equal "first.test" (served-name server)))
              (loop for (target link) in (list (list second-key live-key) (list second live))
                    for temporary = (concatenate 'string link ".new")
                    do (sb-posix:symlink target temporary)
                       (replace-file temporary link))
              (is (wait-until (lambda () (equal "second.test" (served-name server))) :timeout 5)
                  "the certificate the switched link names is served"))))))))

(test renewal.broken-replacement-keeps-the-last-good-one
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (multiple-value-bind (certificate key) (make-test-certificate directory "live" "first.test")
        (let ((log (make-string-output-stream)))
          (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                            :ssl-certificate-file certificate :ssl-privatekey-file key
                                            :message-log-destination log :keep-alive-timeout 60))
            (multiple-value-bind (ask close) (https-keep-alive-check server)
              (unwind-protect
                   (flet ((handshakes-for (seconds)
                            ;; Handshakes over more than one check interval,
                            ;; each still shown the first certificate.
                            (loop with end = (+ (get-internal-real-time) (* seconds internal-time-units-per-second))
                                  while (< (get-internal-real-time) end)
                                  always (equal "first.test" (served-name server))))
                          (failures () (stats server :tls-certificate-reload-failures)))
                     ;; Garbage, renamed over the certificate.
                     (with-open-file (out (concatenate 'string directory "garbage") :direction :output)
                       (write-line "not a certificate" out))
                     (replace-file (concatenate 'string directory "garbage") certificate)
                     (is (wait-until (lambda () (served-name server) (= 1 (failures))) :timeout 5))
                     (is-true (handshakes-for 2.5) "garbage: the first certificate is served")
                     ;; A certificate whose key is not the one beside it.
                     (let ((other (make-test-certificate directory "other" "other.test")))
                       (replace-file other certificate))
                     (is (wait-until (lambda () (served-name server) (= 2 (failures))) :timeout 5))
                     (is-true (handshakes-for 2.5) "a key not the certificate's: the first is served")
                     ;; Half written, in place.
                     (multiple-value-bind (whole whole-key) (make-test-certificate directory "whole" "third.test")
                       (let ((text (uiop:read-file-string whole)))
                         (with-open-file (out certificate :direction :output :if-exists :supersede)
                           (write-string text out :end (floor (length text) 2))))
                       (is (wait-until (lambda () (served-name server) (= 3 (failures))) :timeout 5))
                       (is-true (handshakes-for 1.5) "half a certificate: the first is served")
                       (is (eql 200 (funcall ask)) "the process lives and its connections answer")
                       (let ((lines (count-if (lambda (line) (search "did not load" line))
                                              (uiop:split-string (get-output-stream-string log) :separator '(#\Newline)))))
                         (is (= 3 lines) "one log line for each of three broken replacements, not ~D" lines))
                       ;; The good pair, at last.
                       (replace-file whole-key key)
                       (replace-file whole certificate)
                       (is (wait-until (lambda () (equal "third.test" (served-name server))) :timeout 5))
                       (is (= 3 (failures)) "no handshake came between the two renames")))
                (funcall close)))))))))

(defun resumed-session-p (server session-file protocol &key save)
  "Make a TLS connection to SERVER that asks for /test/yo with s_client's
PROTOCOL options, saving its session to SESSION-FILE when SAVE, else
offering the one saved there.  True when the server resumed the session
offered."
  (let ((output (uiop:run-program
                 (append (list "timeout" "10" "openssl" "s_client" "-connect"
                               (format nil "127.0.0.1:~D" (ht:acceptor-port server)) "-ign_eof"
                               (if save "-sess_out" "-sess_in") session-file)
                         protocol)
                 ;; Connection: close: s_client reads until the reply's
                 ;; end, after the session ticket.
                 :input (make-string-input-stream
                         (crlf-lines "GET /test/yo HTTP/1.1" "Host: x" "Connection: close" ""))
                 :output :string :error-output :output :ignore-error-status t)))
    (and (search "Reused," output) t)))

(test renewal.sessions-resume-across-a-renewal
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (multiple-value-bind (certificate key) (make-test-certificate directory "live" "first.test")
        (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                          :ssl-certificate-file certificate :ssl-privatekey-file key))
          ;; TLS 1.3's tickets, and TLS 1.2's session cache.
          (let ((protocols '(("-tls1_3") ("-tls1_2" "-no_ticket")))
                (sessions (list (concatenate 'string directory "ticket")
                                (concatenate 'string directory "session-id"))))
            (loop for protocol in protocols
                  for session in sessions
                  do (is-false (resumed-session-p server session protocol :save t))
                     (is-true (resumed-session-p server session protocol) "~A: resumed before the renewal" protocol))
            (multiple-value-bind (next next-key) (make-test-certificate directory "next" "second.test")
              (replace-file next-key key)
              (replace-file next certificate))
            (is (= 1 (reload-certificates server)))
            (is (equal "second.test" (served-name server)))
            (loop for protocol in protocols
                  for session in sessions
                  do (is-true (resumed-session-p server session protocol)
                              "~A: a session of before the renewal resumes after it" protocol))))))))

(test reload-certificates.at-once-and-signals-what-does-not-load
  (with-thread-leak-check ()
    (with-scratch-folder (directory)
      (with-server (server (sni-server directory))
        (is (= 0 (reload-certificates server)) "nothing changed, nothing loaded")
        ;; Rewritten in place, key first.
        (multiple-value-bind (next next-key) (make-test-certificate directory "next" "exact2.test")
          (with-open-file (out (concatenate 'string directory "exact.key") :direction :output :if-exists :supersede)
            (write-string (uiop:read-file-string next-key) out))
          (with-open-file (out (concatenate 'string directory "exact.pem") :direction :output :if-exists :supersede)
            (write-string (uiop:read-file-string next) out)))
        (is (= 1 (reload-certificates server)))
        (is (equal "exact2.test" (served-name server "-servername" "exact.test")) "served at once")
        (with-open-file (out (concatenate 'string directory "wild.pem") :direction :output :if-exists :supersede)
          (write-line "garbage" out))
        (signals certificate-not-loaded (reload-certificates server))
        (is (equal "wild.test" (served-name server "-servername" "x.wild.test")) "the last good one kept")
        (is (equal "exact2.test" (served-name server "-servername" "exact.test")))))))

(test alpn.http/1.1-chosen-unknown-protocols-complete-the-handshake
  (with-thread-leak-check ()
    (multiple-value-bind (certificate key) (certificate-files)
      (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                        :ssl-certificate-file certificate :ssl-privatekey-file key))
        (is (search "ALPN protocol: http/1.1" (s-client server "-alpn" "http/1.1")))
        (is (search "ALPN protocol: http/1.1" (s-client server "-alpn" "h2,http/1.1"))
            "h2 is not chosen while HTTP/2 is not served")
        (let ((output (s-client server "-alpn" "foo,spdy/1")))
          (is (search "No ALPN negotiated" output))
          (is (search "Verify return code" output) "the handshake completes, no alert"))
        (is (search "No ALPN negotiated" (s-client server)) "a client offering none gets none")
        (is (wait-until (lambda () (equal '(("h2" . 0) ("http/1.1" . 2) ("other" . 0) ("none" . 2))
                                          (stats server :tls-handshakes-by-protocol))))
            "handshakes by protocol: ~S" (stats server :tls-handshakes-by-protocol))
        (is (search "tls_handshakes_total{protocol=\"http/1.1\"} 2" (prometheus-metrics server)))))))

(test demo.serves-https-with-certificates-by-name
  ;; make run PORT=p TLS_PORT=q TLS_SNI=...: its own certificate made at
  ;; start for the clients naming no other host.
  (with-scratch-folder (directory)
    (multiple-value-bind (exact exact-key) (make-test-certificate directory "exact" "exact.test")
      (multiple-value-bind (wild wild-key) (make-test-certificate directory "wild" "wild.test")
        (let* ((tls-port (free-port))
               (log (concatenate 'string directory "demo.log"))
               (process (launch-demo (free-port) log
                                     :environment (list* (format nil "TLS_PORT=~D" tls-port)
                                                         (format nil "TLS_SNI=exact.test=~A,~A; *.wild.test=~A,~A"
                                                                 exact exact-key wild wild-key)
                                                         (sb-ext:posix-environ)))))
          (is-true process "the demo starts")
          (when process
            (unwind-protect
                 (progn
                   (is (= 1 (log-lines-matching log "with 3 certificates")))
                   (is (equal "exact.test" (served-name tls-port "-servername" "exact.test")))
                   (is (equal "wild.test" (served-name tls-port "-servername" "a.wild.test")))
                   (is (equal "localhost" (served-name tls-port "-noservername")))
                   (is (eql 200 (ignore-errors
                                 (nth-value 1 (drakma:http-request (format nil "https://127.0.0.1:~D/yo" tls-port)
                                                                   :verify nil))))))
              (stop-process process))))))))
