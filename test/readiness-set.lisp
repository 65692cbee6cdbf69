;;;; The readiness-set engine over the wire: limits answered with their
;;;; status, pipelining, parked connections, their timeouts, and STOP.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite readiness :in all :description "The readiness-set engine: parked connections and head limits.")
(in-suite readiness)

(ht:define-easy-handler (test-header :uri "/test/header") (name)
  (setf (ht:content-type*) "text/plain")
  (or (ht:header-in* name) "none"))

(ht:define-easy-handler (test-echo-n :uri "/test/n") (n)
  (setf (ht:content-type*) "text/plain")
  n)

(defun readiness-server (&rest initargs)
  (apply #'make-server 'parallel-easy-acceptor initargs))

(defmacro with-readiness-server ((var &rest initargs) &body body)
  `(with-thread-leak-check ()
     (with-server (,var (readiness-server ,@initargs))
       ,@body)))

(defmacro with-connection ((var server) &body body)
  `(let ((,var (connect ,server)))
     (unwind-protect (progn ,@body)
       (ignore-errors (usocket:socket-close ,var)))))

(defun get-request (path &rest headers)
  (apply #'crlf-lines (format nil "GET ~A HTTP/1.1" path) "Host: localhost" (append headers '(""))))

(defun refused-with (server text)
  "The status SERVER answers TEXT with on a new connection, and whether it
then closed the connection."
  (with-connection (socket server)
    (ignore-errors (send-text socket text))
    (let ((status (read-response socket)))
      (values status (closed-by-server-p socket)))))

(defun connections-parked-p (server count)
  (wait-until (lambda () (= count (stats server :parked-connections)))))

;;; Limits.

(test limits.each-refused-head-gets-its-status-and-is-closed
  (with-readiness-server (server)
    (flet ((check (status key text)
             (multiple-value-bind (answer closed-p) (refused-with server text)
               (is (eql status answer) "~A: expected ~D, got ~S" key status answer)
               (is-true closed-p "~A: the connection is closed" key)
               (is (= 1 (stats server key)) "~A counted" key))))
      (check 414 :uri-too-long-replies
             (get-request (format nil "/~A" (make-string 9000 :initial-element #\a))))
      (check 431 :header-too-large-replies
             (get-request "/test/yo" (format nil "X-Big: ~A" (make-string 17000 :initial-element #\b))))
      (check 400 :bad-request-replies (get-request "/test/yo" "No colon here"))
      (check 505 :version-not-supported-replies (crlf-lines "GET / HTTP/2.0" "Host: x" "")))))

(test limits.rfc-9112-framing-and-host-rules-are-answered
  (with-readiness-server (server)
    (flet ((check (status text why)
             (multiple-value-bind (answer closed-p) (refused-with server text)
               (is (eql status answer) "~A: expected ~D, got ~S" why status answer)
               (is-true closed-p "~A: the connection is closed" why))))
      (check 400 (concatenate 'string
                              (crlf-lines "POST /test/body HTTP/1.0" "Transfer-Encoding: chunked"
                                          "Connection: keep-alive" "")
                              (crlf-lines "1e" "GET /test/yo HTTP/1.0" "" "" "0" ""))
             "HTTP/1.0 with Transfer-Encoding, a request hidden in its body")
      (check 501 (crlf-lines "POST /test/body HTTP/1.1" "Host: x" "Transfer-Encoding: gzip, chunked" ""
                             "0" "")
             "a coding before chunked")
      (check 400 (crlf-lines "GET /test/yo HTTP/1.1" "") "HTTP/1.1 without Host")
      (check 400 (crlf-lines "GET /test/yo HTTP/1.1" "Host: a" "Host: b" "") "two Hosts")
      (check 400 (crlf-lines "GET /test/yo HTTP/1.1" "Host: a b" "") "an invalid Host"))
    (is (= 4 (stats server :bad-request-replies)))
    (is (= 1 (stats server :not-implemented-replies)))
    (with-connection (socket server)
      (send-text socket (crlf-lines "GET http://other.example/test/header?name=host HTTP/1.1"
                                    "Host: mine.example" ""))
      (is (equal "other.example" (nth-value 1 (read-response socket)))
          "a target in absolute form names the host the handler sees"))))

(test limits.too-many-header-lines-is-431
  (with-readiness-server (server)
    (is (eql 431 (refused-with server (apply #'get-request "/test/yo"
                                             (loop for i below 101 collect (format nil "X-~D: ~D" i i))))))))

(test limits.ambiguous-body-length-is-400
  (with-readiness-server (server)
    (is (eql 400 (refused-with server (crlf-lines "POST /test/body HTTP/1.1" "Host: x"
                                                  "Content-Length: 5" "Transfer-Encoding: chunked"
                                                  "" "5" "hello" "0" ""))))
    (is (eql 400 (refused-with server (crlf-lines "POST /test/body HTTP/1.1" "Host: x"
                                                  "Content-Length: 5" "Content-Length: 7" "" "hello!!"))))
    (is (= 2 (stats server :bad-request-replies)))))

(test limits.chunked-body-without-input-chunking-is-411
  (with-readiness-server (server :input-chunking-p nil)
    (is (eql 411 (refused-with server (crlf-lines "POST /test/body HTTP/1.1" "Host: x"
                                                  "Transfer-Encoding: chunked" "" "5" "hello" "0" ""))))
    (is (= 1 (stats server :length-required-replies)))))

(test limits.slow-head-is-408-at-the-header-timeout
  (with-readiness-server (server :header-timeout 1)
    (with-connection (silent server)
      (with-connection (partial server)
        (send-text partial (concatenate 'string (crlf-lines "GET /test/yo HTTP/1.1") "Host: loc"))
        (let ((start (get-internal-real-time)))
          (is (eql 408 (read-response partial :timeout 5)))
          (is (eql 408 (read-response silent :timeout 5)) "a connection that sends nothing too")
          (is (<= 0.9 (/ (- (get-internal-real-time) start) internal-time-units-per-second) 2.5)))
        (is-true (closed-by-server-p partial))
        (is (= 2 (stats server :header-timeout-replies)))))))

(test limits.refusals-end-only-their-connection
  (with-readiness-server (server)
    (with-connection (kept-alive server)
      (send-text kept-alive (get-request "/test/yo"))
      (is (eql 200 (read-response kept-alive)))
      (is (eql 400 (refused-with server (get-request "/test/yo" "Bad header"))))
      (is (eql 414 (refused-with server (get-request (make-string 9000 :initial-element #\a)))))
      (send-text kept-alive (get-request "/test/yo"))
      (is (eql 200 (read-response kept-alive)) "the kept-alive connection still works"))))

;;; Heads that arrive in pieces, and pipelined requests.

(test pipelining.requests-are-answered-in-order
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (concatenate 'string (get-request "/test/n?n=1") (get-request "/test/n?n=2")
                                     (get-request "/test/n?n=3")))
      (is (equal '("1" "2" "3")
                 (loop repeat 3 collect (nth-value 1 (read-response socket))))))))

(test pipelining.body-then-next-request
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (concatenate 'string
                                     (crlf-lines "POST /test/body HTTP/1.1" "Host: x"
                                                 "Content-Type: application/octet-stream"
                                                 "Content-Length: 5" "")
                                     "hello"
                                     (crlf-lines "POST /test/body HTTP/1.1" "Host: x"
                                                 "Content-Type: application/octet-stream"
                                                 "Transfer-Encoding: chunked" ""
                                                 "3" "abc" "0" "")
                                     (get-request "/test/n?n=last")))
      (is (equal (format nil "5 ~D" (reduce #'+ (map 'list #'char-code "hello")))
                 (nth-value 1 (read-response socket))))
      (is (equal (format nil "3 ~D" (reduce #'+ (map 'list #'char-code "abc")))
                 (nth-value 1 (read-response socket))))
      (is (equal "last" (nth-value 1 (read-response socket)))))))

(test pipelining.head-arriving-byte-by-byte
  (with-readiness-server (server)
    (with-connection (socket server)
      (loop for char across (get-request "/test/n?n=slow")
            do (send-text socket (string char))
               (sleep 0.002))
      (is (equal "slow" (nth-value 1 (read-response socket))))
      (is (zerop (stats server :header-timeout-replies))))))

(test pipelining.expect-100-continue
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (crlf-lines "POST /test/body HTTP/1.1" "Host: x" "Expect: 100-continue"
                                    "Content-Type: application/octet-stream" "Content-Length: 2" ""))
      (let ((stream (usocket:socket-stream socket)))
        (is (equal (format nil "HTTP/1.1 100 Continue~C~C~C~C" #\Return #\Linefeed #\Return #\Linefeed)
                   (map 'string #'code-char (loop repeat 25 collect (read-byte stream))))))
      (send-text socket "hi")
      (is (equal (format nil "2 ~D" (+ (char-code #\h) (char-code #\i)))
                 (nth-value 1 (read-response socket)))))))

(test headers.made-up-names-work-by-string-and-are-not-interned
  (with-readiness-server (server)
    (let ((name (format nil "X-Test-~36R" (random (expt 2 64)))))
      (with-connection (socket server)
        (send-text socket (get-request (format nil "/test/header?name=~A" name) (format nil "~A: seen" name)))
        (is (equal "seen" (nth-value 1 (read-response socket)))))
      (is (null (find-symbol (string-upcase name) "KEYWORD"))))))

;;; Parked connections.

(defmacro with-kept-alive-connections ((var server count) &body body)
  "Run BODY with VAR bound to COUNT connections to SERVER, each of which has
been answered one request and is kept alive; closed afterwards."
  `(let ((,var (loop repeat ,count collect (connect ,server))))
     (unwind-protect
          (progn
            (dolist (socket ,var)
              (send-text socket (get-request "/test/yo"))
              (is (eql 200 (read-response socket))))
            ,@body)
       (mapc #'usocket:socket-close ,var))))

(test parking.idle-connections-hold-no-thread
  (with-readiness-server (server :taskmaster (make-instance 'recycling-taskmaster
                                                            :standby-thread-count 1
                                                            :max-thread-count 2
                                                            :max-accept-count 3))
    (with-kept-alive-connections (sockets server 50)
      (is-true (connections-parked-p server 50))
      (is (<= (stats server :threads) 2))
      (with-connection (newcomer server)
        (send-text newcomer (get-request "/test/yo"))
        (is (eql 200 (read-response newcomer)) "a new client is served past 50 idle ones"))
      (dolist (socket sockets)
        (send-text socket (get-request "/test/yo")))
      (is (every (lambda (socket) (eql 200 (read-response socket))) sockets)
          "every idle connection is served again"))))

(test parking.kept-alive-connection-closes-after-keep-alive-timeout
  ;; Two seconds, so that the request sent half a second in is served
  ;; even when collections hold the test up (under heavy collection half a
  ;; second was eaten).
  (with-readiness-server (server :keep-alive-timeout 2)
    (with-connection (socket server)
      (send-text socket (get-request "/test/yo"))
      (is (eql 200 (read-response socket)))
      (is-true (connections-parked-p server 1))
      (is (= 0 (stats server :busy-threads)) "no worker holds the parked connection")
      (sleep 0.5)
      (send-text socket (get-request "/test/yo"))
      (is (eql 200 (read-response socket)) "a request before the timeout is served")
      (let ((start (get-internal-real-time)))
        (is (wait-until (lambda () (= 1 (stats server :keep-alive-timeouts))) :timeout 4))
        (is (<= 1.9 (/ (- (get-internal-real-time) start) internal-time-units-per-second) 3)))
      (is-true (closed-by-server-p socket))
      (is (= 0 (stats server :header-timeout-replies)) "closed without a 408"))))

(defun keep-alive-header (server)
  "The Keep-Alive header SERVER answers an HTTP/1.0 client asking for it with."
  (with-connection (socket server)
    (send-text socket (crlf-lines "GET /test/yo HTTP/1.0" "Connection: keep-alive" ""))
    (multiple-value-bind (status body head) (read-response socket)
      (declare (ignore body))
      (and (eql status 200)
           (cl-ppcre:register-groups-bind (value) ("(?im)^keep-alive:\\s*([^\\r]*)" head)
             value)))))

(test parking.keep-alive-header-names-the-keep-alive-timeout
  (with-readiness-server (server :keep-alive-timeout 3 :read-timeout 20)
    (is (equal "timeout=3" (keep-alive-header server))))
  (with-readiness-server (server :keep-alive-timeout 2.5)
    (is (equal "timeout=2" (keep-alive-header server)) "whole seconds, rounded down")))

(test parking.slow-clients-do-not-delay-others
  ;; Slowloris in small: 100 connections trickle their heads while four
  ;; workers at most serve a normal client.
  (with-readiness-server (server :header-timeout 2
                                 :taskmaster (make-instance 'recycling-taskmaster
                                                            :standby-thread-count 2
                                                            :max-thread-count 4
                                                            :max-accept-count 5))
    (let ((slow (loop repeat 100 collect (connect server)))
          (deadline (+ (get-internal-real-time) (* 3 internal-time-units-per-second))))
      (unwind-protect
           (progn
             (dolist (socket slow) (send-text socket (crlf-lines "GET /test/yo HTTP/1.1")))
             (loop for i from 0
                   while (< (get-internal-real-time) deadline)
                   do (dolist (socket slow)
                        (ignore-errors (send-text socket (format nil "X-~D: ~D~C~C" i i #\Return #\Linefeed))))
                      (is (eql 200 (http-get server "/test/yo")))
                      (sleep 0.2))
             (is (every (lambda (socket) (eql 408 (read-response socket :timeout 2))) slow)
                 "every slow client got 408")
             (is (= 100 (stats server :header-timeout-replies)))
             (is (<= (stats server :peak-threads) 4)))
        (dolist (socket slow)
          (ignore-errors (usocket:socket-close socket)))))))

(test stop.closes-parked-connections-at-once
  (with-thread-leak-check ()
    (let ((server (readiness-server))
          (sockets '()))
      (ht:start server)
      (unwind-protect
           (progn
             (setf sockets (loop repeat 40 collect (connect server)))
             (loop for socket in sockets
                   for i from 0
                   do (send-text socket (if (evenp i)
                                            (get-request "/test/yo")
                                            (concatenate 'string (crlf-lines "GET /test/yo HTTP/1.1")
                                                         "Host: lo"))))
             (loop for socket in sockets
                   for i from 0
                   when (evenp i) do (is (eql 200 (read-response socket))))
             (is-true (connections-parked-p server 40))
             (let ((start (get-internal-real-time)))
               (ht:stop server)
               (is (< (- (get-internal-real-time) start) (/ internal-time-units-per-second 2))
                   "stop does not wait for parked connections"))
             (is (every #'closed-by-server-p sockets))
             (is (= 0 (stats server :parked-connections)))
             (is (= 0 (stats server :open-connections))))
        (mapc #'usocket:socket-close sockets)
        (when (ht:started-p server) (ht:stop server))))))

;;; TLS.

(defun tls-connect (server)
  "A TLS client stream to SERVER, and its socket."
  (let ((socket (connect server)))
    (values (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)
            socket)))

(defun read-stream-response (stream)
  "Status and body of one Content-Length response read from STREAM."
  (let ((octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
    (loop for total = (response-complete-p octets)
          until total
          do (vector-push-extend (read-byte stream) octets)
          finally (let ((text (flex:octets-to-string octets :end total :external-format :latin-1)))
                    (return (values (parse-integer text :start 9 :end 12)
                                    (subseq text (+ 4 (search (format nil "~C~C~C~C" #\Return #\Linefeed
                                                                      #\Return #\Linefeed)
                                                              text)))))))))

(test tls.pipelined-and-split-heads
  (with-thread-leak-check ()
    (multiple-value-bind (certificate key) (certificate-files)
      (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                        :ssl-certificate-file certificate :ssl-privatekey-file key))
        (multiple-value-bind (stream socket) (tls-connect server)
          (unwind-protect
               (flet ((send (text)
                        (write-sequence (flex:string-to-octets text) stream)
                        (finish-output stream)))
                 (send (concatenate 'string (get-request "/test/n?n=1") (get-request "/test/n?n=2")))
                 (is (equal "1" (nth-value 1 (read-stream-response stream))))
                 (is (equal "2" (nth-value 1 (read-stream-response stream))))
                 (is-true (connections-parked-p server 1))
                 (send (concatenate 'string (crlf-lines "GET /test/n?n=3 HTTP/1.1") "Ho"))
                 (is-true (connections-parked-p server 1) "the partial head is parked with its connection")
                 (send (crlf-lines "st: x" ""))
                 (is (equal "3" (nth-value 1 (read-stream-response stream)))))
            (ignore-errors (close stream))
            (usocket:socket-close socket)))))))

;;; Configuration.

(test config.connection-engine-is-no-initarg
  "The readiness set is the only engine: :CONNECTION-ENGINE was retired."
  (signals error (make-instance 'parallel-easy-acceptor :connection-engine :readiness-set)))

(test config.acceptor-rejects-impossible-values
  (flet ((rejected-p (&rest initargs)
           (handler-case (progn (apply #'make-instance 'parallel-easy-acceptor initargs) nil)
             (invalid-acceptor-configuration (condition)
               (and (search "PARALLEL-ACCEPTOR" (princ-to-string condition)) t)))))
    (is (rejected-p :header-timeout 0))
    (is (rejected-p :keep-alive-timeout -1))
    (is (rejected-p :max-header-bytes 10))
    (is (rejected-p :read-timeout 1 :write-timeout 2))
    (is (rejected-p :websocket-timeout 0))
    (is (rejected-p :websocket-ping-interval "30"))
    (is (rejected-p :max-websocket-message-bytes 0))
    (is (rejected-p :max-websocket-queue-bytes nil))
    (is (not (rejected-p :header-timeout 0.5)))))

;;; IPv6.

(defun ipv6-loopback-p ()
  "True when this machine can listen on ::1."
  (handler-case (progn (usocket:socket-close (usocket:socket-listen "::1" 0)) t)
    (error () nil)))

(ht:define-easy-handler (test-both-ends :uri "/test/both-ends") ()
  (setf (ht:content-type*) "text/plain")
  (format nil "~A ~D ~A ~D" (ht:remote-addr*) (ht:remote-port*) (ht:local-addr*) (ht:local-port*)))

(defun both-ends-seen (listen-address connect-address)
  "Ask a parallel acceptor listening on LISTEN-ADDRESS, over a connection to
CONNECT-ADDRESS, for GET /test/both-ends.  The status, the body, and the
text the body should be: the client's address and port, then the server's."
  (with-thread-leak-check ()
    (with-server (server (make-instance 'parallel-easy-acceptor :address listen-address :port 0
                                                                :access-log-destination nil
                                                                :message-log-destination nil))
      (let ((socket (usocket:socket-connect connect-address (ht:acceptor-port server)
                                            :element-type '(unsigned-byte 8))))
        (unwind-protect
             (progn
               (send-text socket (get-request "/test/both-ends"))
               (multiple-value-bind (status body) (read-response socket)
                 (values status body
                         (format nil "~A ~D ~A ~D" connect-address (usocket:get-local-port socket)
                                 connect-address (ht:acceptor-port server)))))
          (usocket:socket-close socket))))))

(test addresses.ipv6-acceptor-reports-ipv6-addresses
  (if (not (ipv6-loopback-p))
      (skip "this machine has no IPv6 loopback")
      (multiple-value-bind (status body expected) (both-ends-seen "::1" "::1")
        (is (eql 200 status))
        (is (equal expected body)))))

(test addresses.wildcard-acceptor-reports-the-address-connected-to
  ;; Listening on every address, our end of each connection is asked of
  ;; its socket; on one address, it is the listening socket's.
  (dolist (address '("0.0.0.0" "127.0.0.1"))
    (multiple-value-bind (status body expected) (both-ends-seen address "127.0.0.1")
      (is (eql 200 status))
      (is (equal expected body) "listening on ~A" address))))

(test addresses.ipv4-in-dotted-quads
  ;; As inet_ntop(3) writes them: decimal octets, no leading zeros.
  (let ((random-state (sb-ext:seed-random-state 42)))
    (dolist (octets (list* '(0 0 0 0) '(255 255 255 255) '(127 0 0 1) '(10 9 100 99) '(1 20 200 5)
                           (loop repeat 500 collect (loop repeat 4 collect (random 256 random-state)))))
      (is (equal (format nil "~{~D~^.~}" octets) (apply #'hrt::dotted-quad octets))))))

;;; A connection's fd-stream.

(defun call-with-accepted-fd (function)
  "Call FUNCTION with the descriptor of a connection accepted on 127.0.0.1
and the client's usocket; both closed after."
  (let* ((listener (hrt::listen-on #(127 0 0 1) 0 4))
         (client (usocket:socket-connect "127.0.0.1" (usocket:get-local-port listener)
                                         :element-type '(unsigned-byte 8)))
         (fd (loop repeat 400
                   thereis (hrt::accept-connection-fd (hrt::socket-file-descriptor listener))
                   do (sleep 0.005))))
    (unwind-protect (funcall function fd client)
      (when fd (sb-unix:unix-close fd))
      (usocket:socket-close client)
      (usocket:socket-close listener))))

(defun forget-fd-stream (stream)
  "Give STREAM's buffers back without closing its descriptor, which the
caller closes."
  (setf (sb-impl::fd-stream-fd stream) -1)
  (close stream :abort t))

(test connection-fd-stream.copied-as-make-fd-stream-makes-it
  ;; Each slot of a copied stream holds what MAKE-FD-STREAM's stream on the
  ;; same descriptor holds, but its buffers and its unread characters,
  ;; which are its own; the copy reads and writes its connection.
  (call-with-accepted-fd
   (lambda (fd client)
     (is (integerp fd))
     ;; The first stream of the process is the one copied after.
     (forget-fd-stream (hrt::make-connection-fd-stream fd 7))
     (dolist (timeout '(7 nil 0.5))
       (let* ((made (hrt::make-fd-stream-for-connection fd timeout))
              (copies (list (hrt::make-connection-fd-stream fd timeout)
                            (hrt::make-connection-fd-stream fd timeout))))
         (dolist (copy copies)
           (dolist (slot (sb-kernel:dd-slots (sb-kernel:find-defstruct-description 'sb-impl::fd-stream)))
             (let* ((name (sb-kernel:dsd-name slot))
                    (ours (funcall (sb-kernel:dsd-accessor-name slot) copy))
                    (theirs (funcall (sb-kernel:dsd-accessor-name slot) made)))
               (case name
                 ((sb-impl::ibuf sb-impl::obuf)
                  (is (and (sb-impl::buffer-p ours) (not (eq ours theirs))
                           (= 0 (sb-impl::buffer-head ours) (sb-impl::buffer-tail ours))
                           (= (sb-impl::buffer-length ours) (sb-impl::buffer-length theirs)))
                      "~A: a buffer of its own" name))
                 (sb-impl::instead
                  (is (and (not (eq ours theirs)) (zerop (length ours)) (adjustable-array-p ours))
                      "unread characters: an array of its own"))
                 (t (is (equalp ours theirs) "~A, timeout ~A: ~S copied, ~S made" name timeout ours theirs))))))
         (is (not (eq (sb-impl::fd-stream-ibuf (first copies)) (sb-impl::fd-stream-ibuf (second copies)))))
         (is (not (eq (sb-impl::fd-stream-obuf (first copies)) (sb-impl::fd-stream-obuf (second copies)))))
         (let ((copy (first copies))
               (client-stream (usocket:socket-stream client)))
           (write-sequence #(1 2 3) copy)
           (finish-output copy)
           (let ((octets (make-array 3 :element-type '(unsigned-byte 8))))
             (read-sequence octets client-stream)
             (is (equalp #(1 2 3) octets)))
           (write-sequence #(4 5) client-stream)
           (finish-output client-stream)
           (let ((octets (make-array 2 :element-type '(unsigned-byte 8))))
             (read-sequence octets copy)
             (is (equalp #(4 5) octets))))
         (mapc #'forget-fd-stream (cons made copies)))))))

(test connection-fd-stream.closed-as-close-closes-it
  ;; Two streams on two descriptors of one connection: one closed by CLOSE
  ;; :ABORT T, one by ours; every slot alike after, both descriptors closed,
  ;; the buffers back in SBCL's pool, and a closed stream left alone.
  (call-with-accepted-fd
   (lambda (fd client)
     (declare (ignore client))
     (let* ((descriptors (list (sb-unix:unix-dup fd) (sb-unix:unix-dup fd)))
            (streams (mapcar (lambda (descriptor) (hrt::make-connection-fd-stream descriptor 7)) descriptors))
            (buffers (list (sb-impl::fd-stream-ibuf (second streams)) (sb-impl::fd-stream-obuf (second streams)))))
       (write-sequence #(1 2 3) (first streams))
       (write-sequence #(1 2 3) (second streams))
       (close (first streams) :abort t)
       (is (eq t (hrt::close-connection-fd-stream (second streams))))
       (dolist (descriptor descriptors)
         (is (null (sb-unix:unix-fstat descriptor)) "descriptor ~D still open" descriptor))
       (is (not (open-stream-p (second streams))))
       (dolist (buffer buffers)
         (is (member buffer sb-impl::*available-buffers*) "a buffer not given back"))
       (dolist (slot (sb-kernel:dd-slots (sb-kernel:find-defstruct-description 'sb-impl::fd-stream)))
         (let ((theirs (funcall (sb-kernel:dsd-accessor-name slot) (first streams)))
               (ours (funcall (sb-kernel:dsd-accessor-name slot) (second streams))))
           (if (eq (sb-kernel:dsd-name slot) 'sb-impl::instead)
               (is (= (length theirs) (length ours)) "unread characters")
               (is (equalp theirs ours) "~A: ~S closed by CLOSE, ~S by ours" (sb-kernel:dsd-name slot) theirs ours))))
       (is (eq t (hrt::close-connection-fd-stream (second streams))) "closed again, nothing done")))))

(test limits.refusals-carry-date-and-server-headers
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (get-request "/test/yo" "No colon here"))
      (multiple-value-bind (status body head) (read-response socket)
        (declare (ignore body))
        (is (eql 400 status))
        (is (cl-ppcre:scan "(?im)^date: \\w{3}, \\d\\d \\w{3} \\d{4} \\d\\d:\\d\\d:\\d\\d GMT\\r$" head)
            "a Date header: ~S" head)
        (is (cl-ppcre:scan "(?im)^server: Hunchentoot \\S+\\r$" head) "a Server header: ~S" head)))))

(test limits.refusals-reach-the-access-log
  (uiop:with-temporary-file (:pathname log :type "log")
    (with-readiness-server (server :access-log-destination log :header-timeout 1)
      (refused-with server (get-request "/test/yo" "No colon here"))
      (refused-with server (crlf-lines "GET / HTTP/2.0" "Host: x" ""))
      (with-connection (silent server)
        (is (eql 408 (read-response silent :timeout 5))))
      (is (eql 200 (http-get server "/test/yo"))))
    (let ((lines (uiop:read-file-lines log)))
      (is (= 4 (length lines)) "one line per reply: ~S" lines)
      (dolist (status '(400 505 408 200))
        (is (find-if (lambda (line) (search (format nil "\" ~D " status) line)) lines)
            "a line for ~D in ~S" status lines))
      (is (every (lambda (line) (eql 0 (search "127.0.0.1 " line))) lines)
          "each with the client's address: ~S" lines))))

(test readiness.prefetching-any-object-never-faults
  ;; PREFETCH-REPORTED-CONNECTION hints at the memory of connections that
  ;; may be gone by then; the hint must never read.  A fixnum's or NIL's
  ;; "address" would fault if it did.
  (dolist (object (list 0 most-positive-fixnum nil (list 1) (make-array 100000) #'car))
    (hrt::prefetch-octets object hrt::*connection-octets*))
  (pass "no prefetch faulted")
  (is (>= hrt::*connection-octets*
          (* 8 (1+ (length (sb-mop:class-slots (find-class 'hrt::connection))))))
      "a prefetched connection is ~D octets, short of its slots" hrt::*connection-octets*))

(test readiness.prefetching-a-queued-connection-reads-what-its-token-names
  ;; RUN-QUEUED-TASKS asks for the objects of the connection queued next,
  ;; which may have gone, or never have had a socket or addresses, or be no
  ;; connection's token at all: each is asked for, or nothing.
  ;; No descriptor of its own: the set is never waited on.
  (let* ((set (hrt::%make-readiness-set :task-fd -1 :timers (hrt::%make-timers -1)
                                           :counters (hrt::make-connection-counters)
                                           :memory-budget (hrt::make-memory-budget 1024)))
         (first hrt::+first-connection-token+)
         (bare (hrt::make-connection -1 first nil))
         (whole (hrt::make-connection -1 (1+ first) nil)))
    (setf (hrt::connection-usocket whole) (make-instance 'hrt::connection-socket :connection whole)
          (hrt::connection-addresses whole) (list "127.0.0.1" 50000 "127.0.0.1" 8080)
          (svref (hrt::readiness-set-slots set) 0) bare
          (svref (hrt::readiness-set-slots set) 1) whole)
    (is (eq whole (hrt::slot-connection set (1+ first))))
    (dolist (token (list hrt::+listen-token+ hrt::+timer-token+ hrt::+task-token+
                         first (1+ first) (+ first 2) (+ first 100000)))
      (finishes (hrt::prefetch-reported-connection-objects set token)))))
