;;;; The socket object Hunchentoot knows a connection by: what
;;;; HUNCHENTOOT:PROCESS-CONNECTION and its :AROUND methods are given, and
;;;; what a handler reaches through the request.

(in-package #:hunchentoot-recycling-taskmaster)

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
