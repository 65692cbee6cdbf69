;;;; Hunchentoot's side of a connection, in one place: the socket object that
;;;; HUNCHENTOOT:PROCESS-CONNECTION and its :AROUND methods are given, and
;;;; the cycle of one request -- Hunchentoot's specials, PROCESS-REQUEST,
;;;; RESET-CONNECTION-STREAM and what it returns -- as Hunchentoot's own
;;;; PROCESS-CONNECTION runs it.  Errors and warnings that escape a request
;;;; are logged by Hunchentoot's PROCESS-CONNECTION :AROUND method, at
;;;; *LISP-ERRORS-LOG-LEVEL* and *LISP-WARNINGS-LOG-LEVEL*.

(in-package #:hunchentoot-recycling-taskmaster)

;;; The socket.

(defclass connection-socket (usocket:stream-usocket)
  ((connection
    :initarg :connection :reader connection-socket-connection
    :documentation "The engine's CONNECTION this socket stands for."))
  (:documentation "The USOCKET that HUNCHENTOOT:PROCESS-CONNECTION is called
with for a connection the engine serves, one per connection.
USOCKET:SOCKET-STREAM is the connection's binary stream on its descriptor
(under TLS, the encrypted one, as Hunchentoot's own socket has it); the
peer's and local address and port answer from what was read at accept.
Closing it (USOCKET:SOCKET-CLOSE) closes the connection."))

(defun make-connection-socket (connection stream)
  (make-instance 'connection-socket :connection connection :stream stream))

(defun address-vector (address)
  "The octet vector USOCKET gives for the textual ADDRESS, IPv4 or IPv6."
  (if (find #\: address)
      (usocket:ipv6-host-to-vector address)
      (usocket:dotted-quad-to-vector-quad address)))

(defun socket-side (socket side)
  "The address (an octet vector, as USOCKET gives it) and port of SIDE, :PEER
or :LOCAL, of SOCKET's connection."
  (destructuring-bind (remote-address remote-port local-address local-port)
      (connection-addresses (connection-socket-connection socket))
    (ecase side
      (:peer (values (address-vector remote-address) remote-port))
      (:local (values (address-vector local-address) local-port)))))

(defmethod usocket:get-peer-name ((socket connection-socket)) (socket-side socket :peer))
(defmethod usocket:get-local-name ((socket connection-socket)) (socket-side socket :local))
(defmethod usocket:get-peer-address ((socket connection-socket)) (values (socket-side socket :peer)))
(defmethod usocket:get-local-address ((socket connection-socket)) (values (socket-side socket :local)))
(defmethod usocket:get-peer-port ((socket connection-socket)) (nth-value 1 (socket-side socket :peer)))
(defmethod usocket:get-local-port ((socket connection-socket)) (nth-value 1 (socket-side socket :local)))

;;; One request.

(defun headers-for-request-initializer (headers)
  "HEADERS as Hunchentoot's request initializer may see them without
interning a keyword from a client's string: it makes a keyword of a text/*
Content-Type's charset to look its external format up.  A charset that
names no keyword yet names no external format either, and the initializer
would ignore it with a warning; here it is left out, Content-Type with it,
with the same warning, and the request is decoded as UTF-8 as before."
  (let* ((content-type (cdr (assoc :content-type headers)))
         (charset (and content-type (ignore-errors (content-type-charset content-type)))))
    (if (or (null charset) (find-symbol (string-upcase charset) :keyword))
        headers
        (progn (warn "Invalid character set ~S in request has been ignored." charset)
               (remove :content-type headers :key #'car)))))

(defun make-request (acceptor head addresses content-stream)
  "The request object, of ACCEPTOR's request class, for the request whose
REQUEST-HEAD is HEAD, on a connection with ADDRESSES (peer address and
port, then ours), whose body is read from CONTENT-STREAM: made without
Hunchentoot's initializer when it can be (see MAKE-PLAIN-REQUEST), else
through it.  Its headers are the client's, whatever the initializer was
shown."
  (destructuring-bind (remote-addr remote-port local-addr local-port) addresses
    (let ((headers (request-head-headers head))
          (method (request-head-method head))
          (uri (request-head-uri head))
          (protocol (request-head-protocol head))
          (constructors *object-constructors*))
      (or (and constructors
               (make-plain-request constructors acceptor headers content-stream method uri protocol
                                   remote-addr remote-port local-addr local-port))
          (let* ((initializer-headers (headers-for-request-initializer headers))
                 (request (if constructors
                              (funcall (object-constructors-request constructors)
                                       acceptor local-addr local-port remote-addr remote-port
                                       initializer-headers content-stream method uri protocol)
                              (make-instance (engine-request-class acceptor)
                                             :acceptor acceptor
                                             :local-addr local-addr :local-port local-port
                                             :remote-addr remote-addr :remote-port remote-port
                                             :headers-in initializer-headers
                                             :content-stream content-stream
                                             :method method :uri uri :server-protocol protocol))))
            (unless (eq initializer-headers headers)
              (setf (request-headers-in request) headers))
            request)))))

(defvar *keep-alive-header-value* nil
  "In a worker, what the Keep-Alive header says: timeout= the whole seconds
a kept-alive connection stays open.  NIL elsewhere.")

(defun keep-alive-header-value (acceptor)
  (format nil "timeout=~D" (floor (acceptor-keep-alive-timeout acceptor))))

(defun answer-request (acceptor head addresses connection-stream content-stream chunked-p)
  "Answer one request, whose REQUEST-HEAD is HEAD, as Hunchentoot's
PROCESS-CONNECTION does: make the request of ACCEPTOR's request class (with
the connection's ADDRESSES: peer address and port, then ours), process it
with Hunchentoot's specials bound, flush the reply and reset the connection
stream.  CONNECTION-STREAM is the connection's stream; the body is read from
CONTENT-STREAM, and CHUNKED-P says that it decodes a chunked body: it is
then also the stream the reply is written to, which is how Hunchentoot
tells that the body is chunked.  Returns :KEEP-ALIVE, :CLOSE (the reply ends
the connection) or :DETACHED (a handler called HUNCHENTOOT:DETACH-SOCKET and
owns the connection now), and the reply's status code."
  (with-request-bindings ()
    (setf (current-connection-stream) (if chunked-p content-stream connection-stream))
    (let ((reply (make-reply acceptor)))
      (let ((hunchentoot:*reply* reply)
            (hunchentoot:*session* nil))
        (call-with-request-counted
         acceptor
         (lambda ()
           (hunchentoot:process-request (make-request acceptor head addresses content-stream)))))
      (finish-output (current-connection-stream))
      (setf (current-connection-stream)
            (hunchentoot:reset-connection-stream acceptor (current-connection-stream)))
      (values (cond ((not (close-connection-stream-p)) :detached)
                    ((finish-processing-connection-p) :close)
                    (t :keep-alive))
              (hunchentoot:return-code reply)))))

;;; A request the engine answers by itself.

(defun log-refused-request (acceptor addresses status)
  "Write the access log entry of a request that the engine answered STATUS
by itself (a refused head, a request that waited too long for a worker)
on a connection with ADDRESSES, through HUNCHENTOOT:ACCEPTOR-LOG-ACCESS as
for any reply: the request object it reads has the client's address and
\"-\" for the method, the path and the protocol, which are not known or
not trusted.  A failure to log is dropped, as by LOG-SAFELY."
  (handler-case
      (destructuring-bind (&optional remote-addr remote-port local-addr local-port) addresses
        (let* ((hunchentoot:*acceptor* acceptor)
               (hunchentoot:*reply* (make-reply acceptor))
               (hunchentoot:*session* nil)
               (hunchentoot:*request*
                 (make-instance (engine-request-class acceptor)
                                :acceptor acceptor
                                :local-addr local-addr :local-port local-port
                                :remote-addr remote-addr :remote-port remote-port
                                :headers-in '() :content-stream nil
                                :method :- :uri "-" :server-protocol :-)))
          (setf (hunchentoot:return-code*) status)
          (hunchentoot:acceptor-log-access acceptor :return-code status)))
    (error () nil)))

