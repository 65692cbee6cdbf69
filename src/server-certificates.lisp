;;;; An SSL acceptor's certificates, as the engine serves them: its own
;;;; (:SSL-CERTIFICATE-FILE), the default, and those :SSL-CERTIFICATES gives
;;;; for other host names, chosen by the name a client's ClientHello gives
;;;; (SNI): the exact name first, then the longest "*.suffix" matching it,
;;;; else the default, as nginx picks its server.  Each is loaded at START
;;;; into a context of its own (cl-plus-ssl-internals.lisp), and again when
;;;; its files change: a handshake begun a second or more after the last
;;;; check looks at every file's signature first; RELOAD-CERTIFICATES
;;;; checks at once.  A replacement that does not load is logged once, and
;;;; the certificate loaded before is served meanwhile.  The files are read
;;;; by the names the acceptor was given, not their truenames, so that a
;;;; symbolic link switched (certbot) is followed.
;;;;
;;;; Locking: CHECK-LOCK is held by the one thread checking; a handshake
;;;; that finds it held goes on with the contexts there are.  A
;;;; certificate's CONTEXT is replaced by one write and read without a lock
;;;; by the servername callback, which switches its connection to it (and
;;;; the connection then holds it); the context it replaced is freed
;;;; +RETIRED-CONTEXT-SECONDS+ later, long after any callback that read it
;;;; has done so.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +certificate-check-seconds+ 1
  "The least time between two looks at the certificate files' signatures.")

(defconstant +retired-context-seconds+ 60
  "How long a certificate context a reload replaced is kept before it is freed.")

(defgeneric acceptor-application-protocols (acceptor)
  (:documentation "The protocols ACCEPTOR's TLS handshakes may choose by ALPN,
as strings, its preference first.  A client that offers none of them gets
no protocol chosen, and no alert.")
  (:method ((acceptor hunchentoot:ssl-acceptor))
    '("http/1.1"))
  (:method ((acceptor parallel-acceptor))
    (if (acceptor-http2-p acceptor) '("h2" "http/1.1") '("http/1.1"))))

(defstruct (certificate (:constructor make-certificate (names certificate-file key-file password)))
  "One certificate and its key, as its files hold them."
  ;; The host names it is chosen for (lower case; "*.example.com" for a
  ;; wildcard); none for the acceptor's own.
  (names '() :type list :read-only t)
  (certificate-file "" :type string :read-only t)
  (key-file "" :type string :read-only t)
  (password nil :read-only t)
  ;; The context loaded from the files, and their signatures when they were
  ;; read for it.
  (context nil)
  (signature nil)
  ;; The signatures of the files the last failed load read: a load is not
  ;; tried again, nor logged again, until they change.
  (refused-signature nil))

(defstruct (certificate-counters (:constructor make-certificate-counters ()))
  "What an engine's certificates have counted, ever, from run to run."
  ;; Certificates loaded again because their files changed.
  (reloads 0 :type word)
  ;; Replacements that did not load, each counted once.
  (reload-failures 0 :type word))

(defstruct (server-certificates (:constructor %make-server-certificates
                                    (acceptor counters default named exact-names wildcard-suffixes)))
  "An SSL acceptor's certificates for one run of its engine."
  (acceptor nil :read-only t)
  (counters nil :type certificate-counters :read-only t)
  (default nil :type certificate :read-only t)
  ;; The certificates of :SSL-CERTIFICATES, in their order.
  (named '() :type list :read-only t)
  ;; Host name -> certificate; for "*.example.com", "example.com" -> certificate.
  (exact-names nil :type hash-table :read-only t)
  (wildcard-suffixes nil :type hash-table :read-only t)
  ;; The front context every handshake begins from, and its TLS-FRONT.
  (front-context nil)
  (front nil)
  (check-lock (bt:make-lock "certificate check") :read-only t)
  ;; Internal real time from which a handshake looks at the files again.
  (next-check 0 :type integer)
  ;; (free-at . context): contexts reloads replaced, each freed at its time.
  (retired '() :type list))

;;; The names a certificate is chosen for.

(defun host-name-label-p (label)
  (and (<= 1 (length label) 63)
       (every (lambda (character)
                (or (char<= #\a character #\z) (char<= #\0 character #\9) (char= character #\-)))
              label)))

(defun certificate-name-p (name)
  "True when NAME (lower case) is a host name, or \"*.\" and a host name."
  (let ((host (if (and (< 2 (length name)) (string= "*." name :end2 2)) (subseq name 2) name)))
    (and (<= 1 (length host) 253)
         (every #'host-name-label-p (split-sequence-by #\. host)))))

(defun split-sequence-by (character string)
  (loop for start = 0 then (1+ end)
        for end = (position character string :start start)
        collect (subseq string start end)
        while end))

(defun certificate-entry-certificate (entry)
  "The CERTIFICATE of one entry of :SSL-CERTIFICATES: a plist of :NAMES (a
host name or a list of them, \"*.example.com\" for a wildcard),
:CERTIFICATE-FILE (PEM, the chain after the certificate),
:PRIVATEKEY-FILE and optionally :PRIVATEKEY-PASSWORD.  Signals
INVALID-ACCEPTOR-CONFIGURATION for anything else."
  (flet ((refuse (reason)
           (error 'invalid-acceptor-configuration :initarg :ssl-certificates :value entry :reason reason)))
    (unless (and (listp entry) (evenp (length entry))
                 (loop for key in entry by #'cddr
                       always (member key '(:names :certificate-file :privatekey-file :privatekey-password))))
      (refuse "each entry must be a plist of :NAMES, :CERTIFICATE-FILE, :PRIVATEKEY-FILE and :PRIVATEKEY-PASSWORD"))
    (destructuring-bind (&key names certificate-file privatekey-file privatekey-password) entry
      (let ((names (mapcar (lambda (name) (and (stringp name) (string-right-trim "." (string-downcase name))))
                           (if (listp names) names (list names)))))
        (unless (and names (every (lambda (name) (and name (certificate-name-p name))) names))
          (refuse ":NAMES must be one or more host names, each maybe \"*.\" and a host name"))
        (unless (and (typep certificate-file '(or string pathname)) (typep privatekey-file '(or string pathname)))
          (refuse ":CERTIFICATE-FILE and :PRIVATEKEY-FILE must be given, as paths"))
        (make-certificate names (file-path certificate-file) (file-path privatekey-file) privatekey-password)))))

(defun file-path (designator)
  "The absolute path of the file DESIGNATOR names, its symbolic links not
resolved."
  (native-path (merge-pathnames designator)))

(defun acceptor-certificates (acceptor)
  "The CERTIFICATEs of ACCEPTOR's :SSL-CERTIFICATES, checked, each name once."
  (let ((certificates (mapcar #'certificate-entry-certificate (acceptor-ssl-certificates acceptor)))
        (names (make-hash-table :test 'equal)))
    (dolist (certificate certificates certificates)
      (dolist (name (certificate-names certificate))
        (when (gethash name names)
          (error 'invalid-acceptor-configuration :initarg :ssl-certificates :value name
                                                 :reason "names one host name twice"))
        (setf (gethash name names) t)))))

(defmethod initialize-instance :after ((acceptor parallel-ssl-acceptor) &key ssl-certificate-file ssl-privatekey-file)
  ;; Hunchentoot keeps the truenames of the files it was given; a renewal
  ;; that switches a symbolic link needs the names themselves.
  (setf (slot-value acceptor 'certificate-path) (file-path ssl-certificate-file)
        (slot-value acceptor 'privatekey-path) (file-path (or ssl-privatekey-file ssl-certificate-file)))
  (acceptor-certificates acceptor))

(defun named-certificate (certificates name)
  "The certificate of CERTIFICATES a ClientHello naming NAME (a string, or
NIL for none) gets."
  (or (and name
           (let ((name (string-right-trim "." (string-downcase name))))
             (or (gethash name (server-certificates-exact-names certificates))
                 (loop with suffixes = (server-certificates-wildcard-suffixes certificates)
                       for dot = (position #\. name) then (position #\. name :start (1+ dot))
                       while dot
                       thereis (gethash (subseq name (1+ dot)) suffixes)))))
      (server-certificates-default certificates)))

;;; Loading, and loading again.

(defun certificate-files-signature (certificate)
  (list (file-signature (certificate-certificate-file certificate))
        (file-signature (certificate-key-file certificate))))

(defun load-certificate (certificates certificate)
  "Load CERTIFICATE's files into a new context, which it serves from now on.
Signals CERTIFICATE-NOT-LOADED, and then keeps what it served."
  (let* ((signature (certificate-files-signature certificate))
         (context (handler-bind ((certificate-not-loaded
                                   (lambda (condition)
                                     (declare (ignore condition))
                                     (setf (certificate-refused-signature certificate) signature))))
                    (make-certificate-tls-context (server-certificates-front certificates)
                                                  (certificate-certificate-file certificate)
                                                  (certificate-key-file certificate)
                                                  (certificate-password certificate))))
         (replaced (certificate-context certificate)))
    (setf (certificate-context certificate) context
          (certificate-signature certificate) signature
          (certificate-refused-signature certificate) nil)
    (when replaced
      (push (cons (+ (get-internal-real-time) (* +retired-context-seconds+ internal-time-units-per-second))
                  replaced)
            (server-certificates-retired certificates)))
    replaced))

(defun reload-certificate (certificates certificate &key again)
  "Load CERTIFICATE again when its files changed since they were loaded, and
since a load last failed unless AGAIN.  A failure is counted and logged, in
one line; returns its CERTIFICATE-NOT-LOADED, else NIL."
  (let ((signature (certificate-files-signature certificate))
        (acceptor (server-certificates-acceptor certificates))
        (counters (server-certificates-counters certificates)))
    (unless (or (equal signature (certificate-signature certificate))
                (and (not again) (equal signature (certificate-refused-signature certificate))))
      (handler-case
          (progn
            (load-certificate certificates certificate)
            (atomic-increment (certificate-counters-reloads counters))
            (hunchentoot:acceptor-log-message acceptor :info "TLS certificate ~A loaded again."
                                              (certificate-certificate-file certificate))
            nil)
        (certificate-not-loaded (condition)
          (atomic-increment (certificate-counters-reload-failures counters))
          (hunchentoot:acceptor-log-message acceptor :error "~A Serving the one loaded before."
                                            (remove #\Newline (princ-to-string condition)))
          condition)))))

(defun check-certificates (certificates &key again)
  "Load again each of CERTIFICATES whose files changed, and free the
contexts replaced long enough ago.  The CERTIFICATE-NOT-LOADED of each
failure, in a list.  The caller holds the check lock."
  (let ((now (get-internal-real-time)))
    (setf (server-certificates-next-check certificates)
          (+ now (* +certificate-check-seconds+ internal-time-units-per-second)))
    (setf (server-certificates-retired certificates)
          (loop for retired in (server-certificates-retired certificates)
                if (<= (car retired) now)
                  do (free-tls-context (cdr retired))
                else collect retired))
    (loop for certificate in (cons (server-certificates-default certificates)
                                   (server-certificates-named certificates))
          for failure = (reload-certificate certificates certificate :again again)
          when failure collect failure)))

(defun check-certificates-when-due (certificates)
  "Check CERTIFICATES' files if a second has passed since they were last
checked and no other thread is checking them."
  (when (<= (server-certificates-next-check certificates) (get-internal-real-time))
    (let ((lock (server-certificates-check-lock certificates)))
      (when (bt:acquire-lock lock nil)
        (unwind-protect (check-certificates certificates)
          (bt:release-lock lock))))))

(defun make-server-certificates (acceptor counters)
  "ACCEPTOR's certificates, each loaded, counting into COUNTERS.  Signals
CERTIFICATE-NOT-LOADED when one does not load."
  (let* ((named (acceptor-certificates acceptor))
         (certificates (%make-server-certificates
                        acceptor counters
                        (make-certificate '() (slot-value acceptor 'certificate-path)
                                          (slot-value acceptor 'privatekey-path)
                                          (hunchentoot:acceptor-ssl-privatekey-password acceptor))
                        named (make-hash-table :test 'equal) (make-hash-table :test 'equal))))
    (dolist (certificate named)
      (dolist (name (certificate-names certificate))
        (if (string= "*." name :end2 (min 2 (length name)))
            (setf (gethash (subseq name 2) (server-certificates-wildcard-suffixes certificates)) certificate)
            (setf (gethash name (server-certificates-exact-names certificates)) certificate))))
    (multiple-value-bind (context front)
        (make-front-tls-context (lambda (name) (certificate-context (named-certificate certificates name)))
                                (acceptor-application-protocols acceptor))
      (setf (server-certificates-front-context certificates) context
            (server-certificates-front certificates) front))
    (handler-bind ((error (lambda (condition)
                            (declare (ignore condition))
                            (free-server-certificates certificates))))
      (dolist (certificate (cons (server-certificates-default certificates) named))
        (load-certificate certificates certificate)))
    (setf (server-certificates-next-check certificates)
          (+ (get-internal-real-time) (* +certificate-check-seconds+ internal-time-units-per-second)))
    certificates))

(defun free-server-certificates (certificates)
  "Free every context of CERTIFICATES; OpenSSL keeps those of connections
still open until they close."
  (dolist (certificate (cons (server-certificates-default certificates)
                             (server-certificates-named certificates)))
    (let ((context (shiftf (certificate-context certificate) nil)))
      (when context (free-tls-context context))))
  (dolist (retired (shiftf (server-certificates-retired certificates) '()))
    (free-tls-context (cdr retired)))
  (let ((context (shiftf (server-certificates-front-context certificates) nil)))
    (when context
      (free-front-tls-context context (server-certificates-front certificates)))))

(defun server-certificates-statistics (certificates counters)
  "The certificates' part of TASKMASTER-STATISTICS: CERTIFICATES (NIL when
the engine takes no handshakes) now, COUNTERS ever."
  (list :tls-certificates (if certificates (1+ (length (server-certificates-named certificates))) 0)
        :tls-certificate-reloads (certificate-counters-reloads counters)
        :tls-certificate-reload-failures (certificate-counters-reload-failures counters)))
