;;;; Every use of a symbol cl+ssl does not export lives in this file, so
;;;; that the next cl+ssl breaks in one place.  cl+ssl's
;;;; MAKE-SSL-SERVER-STREAM, which Hunchentoot's SSL-ACCEPTOR calls for each
;;;; connection, loads the certificate and key files into that connection's
;;;; SSL object and then waits for the whole handshake.  The engine instead
;;;; loads them once into a context of the acceptor's own, and takes the
;;;; handshake one step at a time on the non-blocking socket, parking the
;;;; connection whenever OpenSSL wants more from the client.  The stream it
;;;; ends with is the one MAKE-SSL-SERVER-STREAM returns.

(in-package #:hunchentoot-recycling-taskmaster)

(cffi:defcfun ("SSL_CTX_use_PrivateKey_file" %ssl-ctx-use-private-key-file) :int
  ;; The binding of Debian's cl+ssl (20220328) has no path argument.
  (context :pointer)
  (path :string)
  (type :int))

(cffi:defcfun ("ERR_clear_error" forget-tls-errors) :void
  "Empty the calling thread's OpenSSL error queue.  SSL_get_error(3) takes
any error queued there as the cause of the call it is asked about, so a
queue one connection left (cl+ssl's CLOSE does not read what SSL_shutdown
queues; a handler's own TLS call may leave one) would fail the next
handshake step, read or write the worker takes on another.")

(defun make-server-tls-context (certificate-file key-file password)
  "A new OpenSSL context (SSL_CTX) holding the PEM certificate chain of
CERTIFICATE-FILE and the private key of KEY-FILE, decrypted with PASSWORD
when it is not NIL; not asking clients for certificates.  Signals
CL+SSL:SSL-ERROR-INITIALIZE when a file does not load.  Free it with
FREE-TLS-CONTEXT; OpenSSL keeps it alive while connections made from it
are."
  (let ((context (cl+ssl:make-context :verify-mode cl+ssl:+ssl-verify-none+ :verify-location nil)))
    (handler-bind ((error (lambda (condition)
                            (declare (ignore condition))
                            (cl+ssl:ssl-ctx-free context))))
      (unless (eql 1 (cl+ssl::ssl-ctx-use-certificate-chain-file context (namestring certificate-file)))
        (error 'cl+ssl:ssl-error-initialize
               :reason (format nil "Can't load certificate ~A" certificate-file)))
      (cl+ssl::with-pem-password (password)
        (unless (eql 1 (%ssl-ctx-use-private-key-file context (namestring key-file)
                                                      cl+ssl::+ssl-filetype-pem+))
          (error 'cl+ssl:ssl-error-initialize
                 :reason (format nil "Can't load private key file ~A" key-file))))
      context)))

(defun free-tls-context (context)
  (cl+ssl:ssl-ctx-free context))

(defun start-tls-handshake (context fd-stream)
  "A cl+ssl server stream over FD-STREAM's descriptor, made from CONTEXT,
whose handshake has not begun."
  (let ((stream (make-instance 'cl+ssl::ssl-server-stream :socket fd-stream))
        (handle (cl+ssl::ssl-new context)))
    (when (cffi:null-pointer-p handle)
      (error 'cl+ssl:ssl-error-initialize :reason "Can't create an SSL object"))
    (handler-bind ((error (lambda (condition)
                            (declare (ignore condition))
                            (cl+ssl::ssl-free handle))))
      (cl+ssl::install-handle-and-bio stream handle fd-stream t)
      (cl+ssl::ssl-set-accept-state handle))
    stream))

(defun step-tls-handshake (stream)
  "Take STREAM's handshake as far as what the client has sent allows, without
waiting: :DONE, or :INPUT or :OUTPUT when it waits for the socket to become
readable or writable.  Signals a CL+SSL:SSL-ERROR when the handshake
fails."
  (forget-tls-errors)
  (let* ((handle (cl+ssl::ssl-stream-handle stream))
         (result (let ((cl+ssl::*socket* (cl+ssl::ssl-stream-socket stream)))
                   (cl+ssl::ssl-accept handle))))
    (if (plusp result)
        :done
        (let ((error-code (cl+ssl::ssl-get-error handle result)))
          (cond ((eql error-code cl+ssl::+ssl-error-want-read+) :input)
                ((eql error-code cl+ssl::+ssl-error-want-write+) :output)
                (t (cl+ssl::ssl-signal-error handle 'cl+ssl::ssl-accept error-code result)))))))

(defun abandon-tls-handshake (stream)
  "Free the SSL object of STREAM, whose handshake will not be finished,
without the close_notify that CLOSE would try to send; its socket stays
open."
  (let ((handle (shiftf (cl+ssl::ssl-stream-handle stream) nil)))
    (when handle
      (cl+ssl::ssl-free handle))))

(defconstant +ssl-ctrl-mode+ 33)

(defconstant +ssl-mode-partial-writes+ (logior 1 2)
  "SSL_MODE_ENABLE_PARTIAL_WRITE: SSL_write returns once some records went;
SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER: a write retried after WANT_WRITE may
pass the same octets at another address (the garbage collector moves
vectors).")

(defun send-tls-octets (stream octets start end)
  "Write the OCTETS from START below END through the TLS STREAM (flushed of
what its buffer held) without waiting on its non-blocking socket.  The
count of octets taken, :WOULD-BLOCK when the socket has no room, or :ERROR
(the client has gone, or TLS failed)."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets) (type fixnum start end))
  (let ((handle (cl+ssl::ssl-stream-handle stream)))
    (if (null handle)
        :error
        (handler-case
            (progn
              (forget-tls-errors)
              (cl+ssl::ssl-ctrl handle +ssl-ctrl-mode+ +ssl-mode-partial-writes+ (cffi:null-pointer))
              (let ((result (cffi:with-pointer-to-vector-data (pointer octets)
                              (let ((cl+ssl::*socket* (cl+ssl::ssl-stream-socket stream)))
                                (cl+ssl::ssl-write handle (cffi:inc-pointer pointer start) (- end start))))))
                (if (plusp result)
                    result
                    (let ((error-code (cl+ssl::ssl-get-error handle result)))
                      (if (or (eql error-code cl+ssl::+ssl-error-want-write+)
                              (eql error-code cl+ssl::+ssl-error-want-read+))
                          :would-block
                          :error)))))
          (error () :error)))))
