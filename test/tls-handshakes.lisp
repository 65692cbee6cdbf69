;;;; TLS handshakes hold no worker: clients that connect to an SSL acceptor
;;;; and send nothing, or half a ClientHello, are parked until the header
;;;; timeout closes them, and a handshake that arrives in many small pieces
;;;; is taken piece by piece.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite tls-handshakes :in all :description "TLS handshakes taken without a thread waiting.")
(in-suite tls-handshakes)

(defun tls-server (&rest initargs)
  (multiple-value-bind (certificate key) (certificate-files)
    (apply #'make-server 'parallel-easy-ssl-acceptor
           (append initargs (list :ssl-certificate-file certificate :ssl-privatekey-file key)))))

(defun stalled-handshakes (server count)
  "COUNT connections to SERVER that send nothing, and COUNT that send half a
ClientHello.  The silent ones reach a server only with :DEFER-ACCEPT NIL;
otherwise the kernel keeps them until the header timeout."
  (append (loop repeat count collect (connect server))
          (loop repeat count
                collect (let ((socket (connect server)))
                          (write-sequence *half-client-hello* (usocket:socket-stream socket))
                          (finish-output (usocket:socket-stream socket))
                          socket))))

(test tls-handshake.stalled-clients-hold-no-worker
  (with-thread-leak-check ()
    (with-server (server (tls-server :header-timeout 2 :defer-accept nil
                                     :taskmaster (make-instance 'recycling-taskmaster
                                                                :standby-thread-count 1 :max-thread-count 2)))
      (let ((sockets (stalled-handshakes server 10))
            (start (get-internal-real-time)))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (= 20 (stats server :tls-handshakes))))
                   "twenty handshakes wait, parked: ~D" (stats server :tls-handshakes))
               (is (eql 200 (http-get server "/test/yo" :verify nil))
                   "an HTTPS client is served meanwhile, with two workers at most")
               (is (<= (stats server :threads) 2))
               (dolist (socket sockets)
                 (is (wait-until (lambda () (closed-by-server-p socket)) :timeout 5)
                     "a handshake not done within the header timeout is closed"))
               (let ((seconds (/ (- (get-internal-real-time) start) internal-time-units-per-second)))
                 (is (<= 1.5 seconds 5) "at the header timeout (2 s), not ~,1F s" seconds))
               (is (= 20 (stats server :handshake-timeouts)))
               (is (zerop (stats server :tls-handshakes))))
          (mapc #'usocket:socket-close sockets))))))

(defun relay-in-pieces (from to piece-octets)
  "Copy what arrives on the stream FROM to the stream TO until FROM ends,
flushing after every PIECE-OCTETS octets and whenever nothing more has
arrived, with a pause after each piece so that each goes out alone."
  (ignore-errors
   (loop with sent = 0
         for octet = (read-byte from nil)
         while octet
         do (write-byte octet to)
            (incf sent)
            (when (or (zerop (mod sent piece-octets)) (not (listen from)))
              (finish-output to)
              (sleep 0.001))))
  (ignore-errors (finish-output to)))

(defun trickling-relay (server piece-octets)
  "A relay to SERVER for one connection, which sends what its client sends
in pieces of PIECE-OCTETS.  Returns its port, and a function that waits for
it to end."
  ;; Each direction ends by shutting the other side's output, never by
  ;; closing a socket the other direction may be waiting on: SBCL's wait on
  ;; a descriptor closed under it spins.
  (let* ((listener (usocket:socket-listen "127.0.0.1" 0 :element-type '(unsigned-byte 8) :reuseaddress t))
         (relay (in-thread
                 (lambda ()
                   (let* ((client (unwind-protect (usocket:socket-accept listener)
                                    (usocket:socket-close listener)))
                          (upstream (usocket:socket-connect "127.0.0.1" (ht:acceptor-port server)
                                                            :element-type '(unsigned-byte 8) :nodelay t))
                          (back (in-thread (lambda ()
                                             (relay-in-pieces (usocket:socket-stream upstream)
                                                              (usocket:socket-stream client) 65536)
                                             (ignore-errors (usocket:socket-shutdown client :output))))))
                     (relay-in-pieces (usocket:socket-stream client) (usocket:socket-stream upstream) piece-octets)
                     (ignore-errors (usocket:socket-shutdown upstream :output))
                     (funcall back)
                     (ignore-errors (usocket:socket-close upstream))
                     (ignore-errors (usocket:socket-close client)))))))
    (values (usocket:get-local-port listener) relay)))

(test tls-handshake.taken-piece-by-piece
  (with-thread-leak-check ()
    (with-server (server (tls-server))
      (multiple-value-bind (port relay) (trickling-relay server 7)
        (multiple-value-bind (status body)
            (handler-case (bt:with-timeout (30)
                            (multiple-value-bind (body status)
                                (drakma:http-request (format nil "https://127.0.0.1:~D/test/yo" port)
                                                     :verify nil :close t)
                              (values status body)))
              (serious-condition (condition) (values nil condition)))
          (is (eql 200 status) "a handshake sent 7 octets at a time completes: ~A" body))
        (funcall relay)
        (is (zerop (stats server :tls-handshakes)))))))

(test tls-handshake.stop-closes-handshakes-under-way
  (with-thread-leak-check ()
    (let* ((server (tls-server :defer-accept nil))
           (sockets (progn (ht:start server) (stalled-handshakes server 5))))
      (unwind-protect
           (progn
             (is (wait-until (lambda () (= 10 (stats server :tls-handshakes)))))
             (ht:stop server)
             (dolist (socket sockets)
               (is-true (closed-by-server-p socket) "STOP closes a connection whose handshake waits")))
        (mapc #'usocket:socket-close sockets)))))

(defvar *connection-streams-made* 0)

(defclass own-stream-ssl-acceptor (parallel-easy-ssl-acceptor) ())

(defmethod ht:initialize-connection-stream :around ((acceptor own-stream-ssl-acceptor) stream)
  (declare (ignore stream))
  (incf *connection-streams-made*)
  (call-next-method))

(test tls-handshake.acceptor-with-its-own-stream-method-keeps-it
  ;; An acceptor that makes its connection streams itself (ALPN, client
  ;; certificates...) gets its method called, as with Hunchentoot.
  (with-thread-leak-check ()
    (multiple-value-bind (certificate key) (certificate-files)
      (setf *connection-streams-made* 0)
      (with-server (server (make-server 'own-stream-ssl-acceptor
                                        :ssl-certificate-file certificate :ssl-privatekey-file key))
        (is (eql 200 (http-get server "/test/yo" :verify nil)))
        (is (= 1 *connection-streams-made*) "its INITIALIZE-CONNECTION-STREAM method made the stream")
        (is (zerop (stats server :tls-handshakes)))))))

(test tls-handshake.stop-cuts-a-handshake-the-acceptors-own-method-waits-on
  ;; That method waits on its client outside any request, for as long as
  ;; the read timeout, which here outlasts STOP's own.
  (dolist (soft '(t nil))
    (with-thread-leak-check ()
      (multiple-value-bind (certificate key) (certificate-files)
        (setf *connection-streams-made* 0)
        (let* ((server (make-server 'own-stream-ssl-acceptor
                                    :ssl-certificate-file certificate :ssl-privatekey-file key
                                    :defer-accept nil :read-timeout 600 :write-timeout 600
                                    :taskmaster (make-instance 'recycling-taskmaster :stop-timeout 4)))
               (socket (progn (ht:start server) (connect server))))
          (unwind-protect
               (progn
                 (write-sequence *half-client-hello* (usocket:socket-stream socket))
                 (finish-output (usocket:socket-stream socket))
                 (is (wait-until (lambda () (= 1 *connection-streams-made*))))
                 (is (eq :stopped (handler-case (progn (ht:stop server :soft soft) :stopped)
                                    (error (condition) condition)))
                     "~:[hard~;soft~] STOP ends within its timeout" soft)
                 (is-true (closed-by-server-p socket) "~:[hard~;soft~] STOP closes the connection" soft))
            (usocket:socket-close socket)))))))

(test tls-handshake.key-that-does-not-load-fails-start
  ;; Hunchentoot would only find out at the first connection, in a worker.
  (with-thread-leak-check ()
    (multiple-value-bind (certificate key) (certificate-files)
      (let ((server (make-server 'parallel-easy-ssl-acceptor
                                 :ssl-certificate-file certificate
                                 ;; A file, but no key: Hunchentoot checks only that it exists.
                                 :ssl-privatekey-file certificate)))
        (signals certificate-not-loaded (ht:start server))
        (is (subtypep 'certificate-not-loaded 'cl+ssl:ssl-error-initialize)
            "code that handles cl+ssl's error still does")
        (is-false (ht:started-p server))
        (let ((retry (make-instance 'parallel-easy-ssl-acceptor
                                    :port (ht:acceptor-port server) :address "127.0.0.1"
                                    :access-log-destination nil :message-log-destination nil
                                    :ssl-certificate-file certificate :ssl-privatekey-file key)))
          (with-server (retry retry)
            (is (eql 200 (http-get retry "/test/yo" :verify nil))
                "the port was let go: START works on it once the key is there")))))))

(ht:define-easy-handler (test-leave-openssl-error :uri "/test/leave-openssl-error") ()
  ;; As a handler does whose own TLS call failed and went unexamined: the
  ;; error stays queued in the worker's thread.
  (cffi:foreign-funcall "BIO_new_file" :string "/nonexistent/file" :string "r" :pointer)
  "left")

(defun https-get-twice (server first-path second-path)
  "The statuses of GET FIRST-PATH, then GET SECOND-PATH on the same
kept-alive connection to SERVER (NIL for one that failed), then of GET
SECOND-PATH on a new connection."
  (flet ((get-path (path &rest arguments)
           (handler-case
               (bt:with-timeout (30)
                 (multiple-value-list
                  (apply #'drakma:http-request (url server path) :verify nil :connection-timeout 10 arguments)))
             (serious-condition () nil))))
    (let* ((first (get-path first-path :keep-alive t :close nil))
           (stream (fifth first))
           (second (and stream (get-path second-path :stream stream :close t))))
      (when stream (ignore-errors (close stream)))
      (list (second first) (second second) (second (get-path second-path))))))

(test tls-handshake.error-left-by-a-handler-spoils-no-connection
  ;; OpenSSL reads a failed call's cause from the thread's error queue; one
  ;; left there would fail the next read, write or handshake step the worker
  ;; takes, on any connection.
  (with-thread-leak-check ()
    (with-server (server (tls-server :taskmaster (make-instance 'recycling-taskmaster
                                                                :standby-thread-count 1 :max-thread-count 1)))
      (dotimes (round 3)
        (is (equal '(200 200 200) (https-get-twice server "/test/leave-openssl-error" "/test/yo"))
            "round ~D: the next request on the connection, and a new connection: ~S"
            round (https-get-twice server "/test/leave-openssl-error" "/test/yo"))))))

(defun openssl-client-output (server &rest arguments)
  "What `openssl s_client` printed connecting to SERVER with ARGUMENTS,
having sent one GET /test/yo that closes the connection."
  (uiop:run-program (append (list "timeout" "20" "openssl" "s_client" "-connect"
                                  (format nil "127.0.0.1:~D" (ht:acceptor-port server)) "-ign_eof")
                            arguments)
                    :input (make-string-input-stream
                            (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" "Connection: close" ""))
                    :output :string :error-output :output :ignore-error-status t))

(test tls-handshake.sessions-are-resumed
  ;; A client that comes back with its session skips the key exchange, as
  ;; with nginx: a ticket (TLS 1.3), a ticket or the session cache (1.2).
  (with-thread-leak-check ()
    (with-server (server (tls-server))
      (uiop:with-temporary-file (:pathname session)
        (let ((first (openssl-client-output server "-tls1_3" "-sess_out" (namestring session)))
              (second (openssl-client-output server "-tls1_3" "-sess_in" (namestring session))))
          (is (search "New, TLSv1.3" first) "first connection: ~A" first)
          (is (search "Hey!" first))
          (is (search "Reused, TLSv1.3" second) "second connection: ~A" second)
          (is (search "Hey!" second))))
      (let ((output (openssl-client-output server "-tls1_2" "-reconnect")))
        (is (search "New, TLSv1.2" output) "~A" output)
        (is (<= 5 (length (cl-ppcre:all-matches-as-strings "Reused, TLSv1.2" output))) "~A" output)))))
