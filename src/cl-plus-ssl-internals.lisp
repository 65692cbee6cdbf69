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

;;; An acceptor's TLS contexts: a front context each connection's SSL object
;;; is made from, which keeps the sessions (cache and ticket keys) and
;;; names no certificate, and a context per certificate, which the
;;; servername callback switches the connection to (SSL_set_SSL_CTX) once
;;; the ClientHello has named a host or not: OpenSSL calls it in either
;;; case, after resumption was decided, so resumption outlives a
;;; certificate's context.  Both callbacks find their acceptor's front
;;; through *TLS-FRONTS*, by the number OpenSSL passes them.

(defstruct (tls-front (:constructor make-tls-front (id choose protocols)))
  "What the callbacks of one front context consult."
  ;; The number the callbacks are passed, as a pointer's address.
  (id 0 :type fixnum :read-only t)
  ;; A function of the host name the ClientHello gave (a string, or NIL
  ;; when it gave none) to the certificate context to switch to.
  (choose nil :type function :read-only t)
  ;; The protocols ALPN may choose, the server's preference first, each as
  ;; octets.
  (protocols '() :type list :read-only t))

(defvar *tls-fronts* (make-hash-table :synchronized t)
  "Every front context's TLS-FRONT, by its ID.")

(defvar *tls-front-count* (list 0)
  "The ID of the last TLS-FRONT made, in a cons for ATOMIC-INCF.")

(defun find-tls-front (argument)
  (gethash (cffi:pointer-address argument) *tls-fronts*))

(defun tls-client-server-name (ssl)
  "The host name SSL's ClientHello gave (OpenSSL refuses any over 255
octets or with a NUL), or NIL."
  (let ((name (%ssl-get-servername ssl +tlsext-nametype-host-name+)))
    (unless (cffi:null-pointer-p name)
      (cffi:foreign-string-to-lisp name :max-chars 255 :encoding :latin-1))))

(cffi:defcallback switch-to-named-certificate :int ((ssl :pointer) (alert :pointer) (argument :pointer))
  (declare (ignore alert))
  ;; Nothing may unwind through OpenSSL's frames: any error ends the
  ;; handshake with an alert.
  (handler-case
      (let* ((front (find-tls-front argument))
             (context (and front (funcall (tls-front-choose front) (tls-client-server-name ssl)))))
        (cond ((or (null context) (cffi:null-pointer-p (%ssl-set-ssl-ctx ssl context)))
               +ssl-tlsext-err-alert-fatal+)
              (t +ssl-tlsext-err-ok+)))
    (error () +ssl-tlsext-err-alert-fatal+)))

(defun offered-protocol-position (protocol offered offered-octets)
  "Where the octets of PROTOCOL start in the ALPN list OFFERED (a foreign
pointer to OFFERED-OCTETS octets: each protocol its length octet, then
itself), or NIL when it is not there."
  (declare (type (simple-array (unsigned-byte 8) (*)) protocol) (type fixnum offered-octets))
  (loop with length = (length protocol)
        for position = 0 then (+ position 1 octets)
        for octets = (and (< position offered-octets) (cffi:mem-aref offered :uint8 position))
        while (and octets (<= (+ position 1 octets) offered-octets))
        when (and (= octets length)
                  (loop for index below length
                        always (= (aref protocol index) (cffi:mem-aref offered :uint8 (+ position 1 index)))))
          return (1+ position)))

(cffi:defcallback choose-application-protocol :int
    ((ssl :pointer) (out :pointer) (out-length :pointer) (offered :pointer) (offered-octets :unsigned-int)
     (argument :pointer))
  (declare (ignore ssl))
  ;; A client offering none of ours gets no ALPN and no alert (NOACK).
  (handler-case
      (let ((front (find-tls-front argument)))
        (dolist (protocol (if front (tls-front-protocols front) '()) +ssl-tlsext-err-noack+)
          (let ((position (offered-protocol-position protocol offered offered-octets)))
            (when position
              (setf (cffi:mem-ref out :pointer) (cffi:inc-pointer offered position)
                    (cffi:mem-ref out-length :uint8) (length protocol))
              (return +ssl-tlsext-err-ok+)))))
    (error () +ssl-tlsext-err-noack+)))

(defun make-tls-context ()
  "A new server context as cl+ssl makes them (its protocols, ciphers and
session cache), not asking clients for certificates."
  (cl+ssl:make-context :verify-mode cl+ssl:+ssl-verify-none+ :verify-location nil))

(defun use-application-protocols (context front)
  (%ssl-ctx-set-alpn-select-cb context (cffi:callback choose-application-protocol)
                               (cffi:make-pointer (tls-front-id front))))

(defun make-front-tls-context (choose protocols)
  "A new front context and its TLS-FRONT: each handshake's SSL object is
made from the context; CHOOSE, a function of the host name a ClientHello
gave (or NIL), returns the certificate context (MAKE-CERTIFICATE-TLS-CONTEXT
with the TLS-FRONT) the connection switches to; ALPN chooses the first of
PROTOCOLS (strings) the client offers.  Free it with FREE-FRONT-TLS-CONTEXT."
  (let* ((front (make-tls-front (1+ (atomic-increment (car *tls-front-count*))) choose
                                (mapcar (lambda (protocol) (sb-ext:string-to-octets protocol :external-format :latin-1))
                                        protocols)))
         (context (make-tls-context)))
    (setf (gethash (tls-front-id front) *tls-fronts*) front)
    (%ssl-ctx-callback-ctrl context +ssl-ctrl-set-tlsext-servername-cb+ (cffi:callback switch-to-named-certificate))
    (%ssl-ctx-ctrl context +ssl-ctrl-set-tlsext-servername-arg+ 0 (cffi:make-pointer (tls-front-id front)))
    (use-application-protocols context front)
    (values context front)))

(defun free-front-tls-context (context front)
  (remhash (tls-front-id front) *tls-fronts*)
  (free-tls-context context))

(defun tls-error-reason ()
  "OpenSSL's reason for the first error of the calling thread's queue, as a phrase."
  (let ((reason (%err-reason-error-string (%err-peek-error))))
    (if (cffi:null-pointer-p reason)
        "no reason given"
        (cffi:foreign-string-to-lisp reason :encoding :latin-1))))

(defun make-certificate-tls-context (front certificate-file key-file password)
  "A new context holding the PEM certificate chain of CERTIFICATE-FILE and
the private key of KEY-FILE, decrypted with PASSWORD when it is not NIL,
choosing ALPN as FRONT does.  Signals CERTIFICATE-NOT-LOADED when a file
does not load or the key is not the certificate's.  Free it with
FREE-TLS-CONTEXT; OpenSSL keeps it alive while connections switched to it
are."
  (let ((context (make-tls-context)))
    (flet ((refuse (format-control &rest arguments)
             (let ((reason (apply #'format nil format-control arguments)))
               (forget-tls-errors)
               (error 'certificate-not-loaded :certificate-file certificate-file :key-file key-file
                                              :reason reason))))
      (handler-bind ((error (lambda (condition)
                              (declare (ignore condition))
                              (cl+ssl:ssl-ctx-free context))))
        (forget-tls-errors)
        (unless (eql 1 (cl+ssl::ssl-ctx-use-certificate-chain-file context certificate-file))
          (refuse "its certificate chain does not load (~A)" (tls-error-reason)))
        (unless (eql 1 (cl+ssl:with-pem-password (password)
                         (%ssl-ctx-use-private-key-file context key-file cl+ssl::+ssl-filetype-pem+)))
          (refuse "its private key does not load (~A)" (tls-error-reason)))
        (unless (eql 1 (%ssl-ctx-check-private-key context))
          (refuse "the private key is not the certificate's (~A)" (tls-error-reason)))
        (use-application-protocols context front)
        context))))

(defun free-tls-context (context)
  (cl+ssl:ssl-ctx-free context))

(defun tls-stream-application-protocol (stream)
  "The protocol ALPN chose for the TLS STREAM, a string, or NIL when none was."
  (let ((handle (cl+ssl::ssl-stream-handle stream)))
    (when handle
      (cffi:with-foreign-objects ((data :pointer) (length :unsigned-int))
        (%ssl-get0-alpn-selected handle data length)
        (let ((octets (cffi:mem-ref length :unsigned-int)))
          (when (plusp octets)
            (cffi:foreign-string-to-lisp (cffi:mem-ref data :pointer) :count octets :encoding :latin-1)))))))

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

(defun call-tls-io (stream function octets start end)
  "Call FUNCTION, cl+ssl's SSL-READ or SSL-WRITE, on the TLS STREAM's
handle with the OCTETS from START below END, without waiting on its
non-blocking socket: the count of octets read or written, 0 at the end of
the stream, :WOULD-BLOCK when the socket has nothing or no room, or :ERROR
(the client has gone, or TLS failed)."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets) (type fixnum start end))
  (let ((handle (cl+ssl::ssl-stream-handle stream)))
    (if (null handle)
        :error
        (handler-case
            (progn
              (forget-tls-errors)
              (let ((result (cffi:with-pointer-to-vector-data (pointer octets)
                              (let ((cl+ssl::*socket* (cl+ssl::ssl-stream-socket stream)))
                                (funcall function handle (cffi:inc-pointer pointer start) (- end start))))))
                (if (plusp result)
                    result
                    (let ((error-code (cl+ssl::ssl-get-error handle result)))
                      (cond ((or (eql error-code cl+ssl::+ssl-error-want-read+)
                                 (eql error-code cl+ssl::+ssl-error-want-write+))
                             :would-block)
                            ((eql error-code cl+ssl::+ssl-error-zero-return+) 0)
                            (t :error))))))
          (error () :error)))))

(defun send-tls-octets (stream octets start end)
  "Write the OCTETS from START below END through the TLS STREAM (flushed of
what its buffer held) without waiting on its non-blocking socket
(CALL-TLS-IO): the count of octets taken, :WOULD-BLOCK when the socket has
no room, else 0 or :ERROR (the client has gone, or TLS failed)."
  (let ((handle (cl+ssl::ssl-stream-handle stream)))
    (when handle
      (cl+ssl::ssl-ctrl handle +ssl-ctrl-mode+ +ssl-mode-partial-writes+ (cffi:null-pointer)))
    (call-tls-io stream #'cl+ssl::ssl-write octets start end)))

(defun tls-stream-p (stream)
  "True when STREAM is cl+ssl's own TLS stream, which RECEIVE-TLS-OCTETS reads."
  (typep stream 'cl+ssl::ssl-stream))

(defun receive-tls-octets (stream octets start end)
  "Read into OCTETS from START below END what the TLS STREAM has decrypted
or can decrypt without waiting on its non-blocking socket, in one
SSL_read (CALL-TLS-IO), after the octet LISTEN peeked, if any: the count,
0 at the end of the stream, :WOULD-BLOCK, or :ERROR.  cl+ssl's READ-BYTE
and LISTEN take one SSL_read an octet."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets) (type fixnum start))
  (let ((peeked (shiftf (cl+ssl::ssl-stream-peeked-byte stream) nil)))
    (if peeked
        (progn (setf (aref octets start) peeked) 1)
        (call-tls-io stream #'cl+ssl::ssl-read octets start end))))
