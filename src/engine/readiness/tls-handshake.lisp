;;;; TLS handshakes taken without a thread waiting.  On an SSL acceptor
;;;; whose connection streams are Hunchentoot's own (no method of the
;;;; user's on HUNCHENTOOT:INITIALIZE-CONNECTION-STREAM), the engine loads
;;;; the certificates at START (server-certificates.lisp) and takes each
;;;; connection's handshake as far as the client's bytes allow, parking the
;;;; connection whenever OpenSSL wants to read or write more.  A handshake
;;;; not done within the header timeout of the accept is closed without a
;;;; word: there is no HTTP to answer in yet.  An acceptor with such a method
;;;; keeps Hunchentoot's way, the whole handshake inside that method, done
;;;; by the worker.  Only the connection's holder touches its HANDSHAKE
;;;; (connection.lisp, Ownership).

(in-package #:hunchentoot-recycling-taskmaster)

(defun handshake-by-engine-p (acceptor)
  "True when ACCEPTOR is an SSL acceptor whose INITIALIZE-CONNECTION-STREAM
methods are all Hunchentoot's, so that the engine may make the stream they
would."
  (and (typep acceptor 'hunchentoot:ssl-acceptor)
       (let ((methods (applicable-methods #'hunchentoot:initialize-connection-stream
                                          (class-of acceptor) (fd-stream-class))))
         (and (listp methods)
              (every (lambda (method)
                       (member (method-specializer method)
                               (list (find-class 'hunchentoot:acceptor) (find-class 'hunchentoot:ssl-acceptor))))
                     methods)))))

(defun make-acceptor-certificates (acceptor counters)
  "ACCEPTOR's SERVER-CERTIFICATES counting into COUNTERS, or NIL when the
engine does not take ACCEPTOR's handshakes: then :SSL-CERTIFICATES, which
only the engine serves, must be empty."
  (cond ((handshake-by-engine-p acceptor)
         (make-server-certificates acceptor counters))
        ((and (typep acceptor 'parallel-ssl-acceptor) (acceptor-ssl-certificates acceptor))
         (error 'invalid-acceptor-configuration
                :initarg :ssl-certificates :value (acceptor-ssl-certificates acceptor)
                :reason "needs the engine's TLS handshakes, which an INITIALIZE-CONNECTION-STREAM method of the acceptor's own replaces"))))

(defun begin-connection-handshake (set certificates connection)
  "Make CONNECTION's HANDSHAKE: a TLS stream from CERTIFICATES' front
context over its socket, its handshake not begun, after looking at the
certificate files if it is time to.  NIL when OpenSSL cannot make one."
  (check-certificates-when-due certificates)
  (let ((stream (ignore-errors (start-tls-handshake (server-certificates-front-context certificates)
                                                    (connection-fd-stream connection)))))
    (when stream
      (atomic-increment (readiness-set-handshake-count set))
      (setf (connection-handshake connection) stream))))

(defun forget-connection-handshake (set connection)
  "CONNECTION has no handshake under way any more."
  (setf (connection-handshake connection) nil)
  (atomic-decrement (readiness-set-handshake-count set)))

(defun continue-connection-handshake (set certificates connection)
  "Take CONNECTION's TLS handshake, begun from CERTIFICATES if it has not
been, as far as it goes without waiting.  Returns the connection's stream
once the handshake is done; :INPUT or :OUTPUT when it waits for the
socket; NIL when it failed (the caller closes the connection, which frees
it)."
  (let ((stream (or (connection-handshake connection)
                    (begin-connection-handshake set certificates connection))))
    (when stream
      (let ((state (handler-case (step-tls-handshake stream)
                     (error () nil))))
        (when (eq state :done)
          (forget-connection-handshake set connection)
          (let ((protocol (tls-stream-application-protocol stream)))
            (setf (connection-application-protocol connection) protocol)
            (count-tls-handshake (readiness-set-counters set) protocol))
          (setf (connection-awaiting connection) :input))
        (if (eq state :done) stream state)))))

(defun end-connection-handshake (set connection)
  "Abandon the handshake under way on CONNECTION, which is being closed."
  (abandon-tls-handshake (connection-handshake connection))
  (forget-connection-handshake set connection))
